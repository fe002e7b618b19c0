"""The user's functions a config names by dotted path, imported and checked at validation (dry runs included):
a target that does not import, is not callable, or cannot take the arguments the platform passes is refused here,
naming the key and the import error, instead of inside a Ray actor half a minute into the run.

    key                   when                         called as
    reward.target         reward=custom                fn(response, label, metadata) (or a @group_reward fn of lists)
    rollout.generate      set                          await fn(ctx, sample, sampling_params)
    algo.dynamic_filter   a dotted path                fn(samples_of_one_group)
    cluster.job_body      cluster.scheduler=slurm      fn(cfg, run_dir)

Importing runs the module's top level, as the run would; ``dotted.import_callable`` is the one importer.
"""

import inspect
from typing import Any, Callable, Iterator, Optional

from slime_hydra.config.schema import SlimeConfig
from slime_hydra.dotted import import_callable
from slime_hydra.options import Problem


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
