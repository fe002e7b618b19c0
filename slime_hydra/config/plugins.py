"""The user's functions a config names by dotted path, imported and checked at validation (dry runs included):
a target that does not import, is not callable, or cannot take the arguments the platform passes is refused here,
naming the key and the import error, instead of inside a Ray actor half a minute into the run.

    key                   when                         called as
    reward.target         reward=custom                fn(response, label, metadata) (or a @group_reward fn of lists)
    rollout.generate      set                          await fn(ctx, sample, sampling_params)
    algo.dynamic_filter   a dotted path                fn(samples_of_one_group)
    cluster.job_body      cluster.scheduler=slurm      fn(cfg, run_dir)

Importing runs the module's top level, as the run would; ``dotted.import_callable`` is the one importer.

``check_reward_call`` then calls a custom reward once on a real row of the run's data, with the row's label as the
response (a @group_reward function: a group of ``rollout.n_samples_per_prompt`` of them; async ones awaited): an
exception, a value that is not a finite number, a dict without ``reward.reward_key``, a group of the wrong size, or
a call past ``reward.timeout_s`` is refused here rather than at the first scored group. The call runs in a daemon
thread and is waited for at most CALL_BOUND_S: a reward that never returns (the stall doctor's case) neither holds
the launch nor its exit. Not through reward/scorer.RewardScorer, whose pool threads the interpreter joins at exit.
"""

import asyncio
import inspect
import math
import sys
import threading
import traceback
from typing import Any, Callable, Iterator, Optional

from slime_hydra.config.schema import SlimeConfig
from slime_hydra.dotted import import_callable
from slime_hydra.options import Problem

CALL_BOUND_S = 30.0
"""Seconds the pre-flight waits for the reward's one call at most (or reward.timeout_s when shorter): past it a
call is not checked (a first call may load a model), unless reward.timeout_s itself has passed."""


def _targets(cfg: SlimeConfig) -> list[tuple[str, str, str, int, bool]]:
    """(key, dotted path, expected signature in words, positional arguments, must be async) of each target set."""
    out = []
    if cfg.reward.name == "custom" and cfg.reward.target and "." in cfg.reward.target:
        out.append(("reward.target", cfg.reward.target, "fn(response, label, metadata)", 3, False))
    if cfg.rollout.generate and "." in cfg.rollout.generate:
        out.append(("rollout.generate", cfg.rollout.generate, "async def generate(ctx, sample, sampling_params)",
                    3, True))
    if cfg.algo.dynamic_filter and cfg.algo.dynamic_filter != "nonzero_std" and "." in cfg.algo.dynamic_filter:
        out.append(("algo.dynamic_filter", cfg.algo.dynamic_filter, "fn(group) -> bool | (bool, reason)", 1, False))
    if cfg.cluster.scheduler == "slurm":
        out.append(("cluster.job_body", cfg.cluster.job_body, "fn(cfg, run_dir)", 2, False))
    return out


def check_plugins(cfg: SlimeConfig) -> Iterator[Problem]:
    for key, path, expects, arity, must_be_async in _targets(cfg):
        try:
            fn = import_callable(path, key, expects)
        except ValueError as error:
            yield Problem((key,), str(error).removeprefix(f"{key}={path!r} "), f"set {key} to {expects}")
            continue
        problem = _signature_problem(fn, arity, must_be_async)
        if problem:
            yield Problem((key,), f"{path} {problem}", f"give {key} a callable {expects}")


def _signature_problem(fn: Callable, arity: int, must_be_async: bool) -> Optional[str]:
    """Why ``fn`` cannot be called with ``arity`` positional arguments (and awaited), or None."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the run find out
        return None
    try:
        signature.bind(*([None] * arity))
    except TypeError as error:
        return f"cannot take {arity} positional argument{'s' if arity > 1 else ''} {signature}: {error}"
    if must_be_async and not _is_async(fn):
        return "is not async (the rollout awaits it)"
    return None


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def check_reward_call(cfg: SlimeConfig, first_rows: dict[str, tuple]) -> Iterator[Problem]:
    """reward=custom called once on the first row of the training data (``first_rows["data.path"]``, as
    config/datasets.check_datasets found it, or the task's first row); nothing for the built-in and remote rewards."""
    if cfg.reward.name != "custom":
        return
    row = first_rows.get("data.path") or _first_task_row(cfg)
    if row is None:
        return
    from slime_hydra.reward.registry import get_reward_fn, is_group_reward

    _, label, metadata = row
    response = "" if label is None else str(label)
    n = cfg.rollout.n_samples_per_prompt
    called = f"{cfg.reward.target}({response[:40]!r}, label={label!r:.60}, metadata)"
    fn = get_reward_fn("custom", cfg.reward.target)
    group = is_group_reward(fn)
    outcome: dict = {}
    thread = threading.Thread(target=_call, args=(fn, ([response] * n, [label] * n, [metadata] * n) if group
                                                  else (response, label, metadata), outcome),
                              name="reward-preflight", daemon=True)  # a call that never returns cannot hold exit
    bound = min(cfg.reward.timeout_s, CALL_BOUND_S)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        if bound == cfg.reward.timeout_s:
            yield Problem(("reward.target", "reward.timeout_s"), f"{called} took over reward.timeout_s="
                          f"{cfg.reward.timeout_s} s on the data's first row: the run would score such responses 0",
                          "make it faster, or raise reward.timeout_s")
        else:
            print(f"slime_hydra: warning: {called} did not return within {bound:g} s on the data's first row; "
                  "its answer is not checked before the run", file=sys.stderr)
        return
    error = outcome.get("error")
    if error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        yield Problem(("reward.target",), f"{called} on the data's first row raised {type(error).__name__}: "
                      f"{error}{where}", "make it return a float (or a dict and reward.reward_key) for every response")
        return
    rewards = outcome["value"] if group else [outcome["value"]]
    if group and (not isinstance(rewards, (list, tuple)) or len(rewards) != n):
        count = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        yield Problem(("reward.target",), f"group reward {called} returned {count} rewards for {n} responses",
                      "return one reward per response, in order")
        return
    value, key = rewards[0], cfg.reward.reward_key
    if isinstance(value, dict) and key not in value:
        yield Problem(("reward.reward_key", "reward.target"), f"{called} returned a dict with keys {sorted(value)}, "
                      f"and reward.reward_key={key} names none of them",
                      f"set reward.reward_key to the key of the scalar (one of {', '.join(map(str, value))})")
        return
    scalar = value[key] if isinstance(value, dict) else value
    try:
        finite = math.isfinite(float(scalar))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        yield Problem(("reward.target",), f"{called} returned {value!r:.80} on the data's first row"
                      + (f" (reward.reward_key={key})" if isinstance(value, dict) else ""),
                      "return a finite float (or a dict whose reward.reward_key holds one)")


def _call(fn: Callable, args: tuple, outcome: dict) -> None:
    """fn(*args), awaited if it is async; its value or what it raised goes to ``outcome``."""
    try:
        value = fn(*args)
        outcome["value"] = asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value
    except BaseException as error:  # SystemExit too: reported, never raised in the launch
        outcome["error"] = error


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _first_task_row(cfg: SlimeConfig) -> Optional[tuple]:
    """(prompt, label, metadata) of the built-in task's first training row, or None without one."""
    if cfg.data.path is not None or cfg.data.task is None:
        return None
    from slime_hydra.data.dataset import task_levels
    from slime_hydra.data.tasks import Environment, get_task

    task = get_task(cfg.data.task)
    rows = (task.rows("train", seed=cfg.data.seed, levels=task_levels(cfg.data, "train"))
            if isinstance(task, Environment) else task.rows("train", seed=cfg.data.seed))
    row = rows[0]
    return row["prompt"], row.get("label"), row.get("metadata") or {}
