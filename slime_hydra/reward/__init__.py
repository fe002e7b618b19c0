"""The reward hub: ``get_reward_fn(name)`` and the ``RewardScorer`` the rollout uses.

    fn = get_reward_fn("math")                 # fn(response, label, metadata) -> float | dict
    scorer = RewardScorer(cfg.reward)
    rewards = await scorer.score_group(responses, labels, metadatas)

Built-ins (reward.name): ``math`` and ``deepscaler`` (reward/math.py), ``dapo`` (reward/dapo.py), ``f1``,
``gpqa``, ``exact_match``, ``random`` (reward/text.py), ``remote`` (reward/remote.py, configured by reward.url,
timeout_s, max_retries, backoff_s). ``custom`` imports ``reward.target``, a dotted path to your function.

A function marked with ``@group_reward`` is called once per group instead:
``fn(responses, labels, metadatas) -> list[float | dict]`` (e.g. rewards ranked within the group).

Concurrency: rule rewards (plain functions) run in a thread pool of ``reward.max_concurrency`` threads and
``async def`` rewards (remote, or a custom coroutine) run on the event loop with at most ``max_concurrency`` in
flight, so a slow verifier never serialises the rollout. A rule reward call taking longer than
``RULE_TIMEOUT_S`` scores 0 (its thread is left to finish; counted in ``timeouts``).
"""

import asyncio
import difflib
import importlib
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from slime_hydra.reward.config import RewardConfig
from slime_hydra.reward.dapo import dapo_reward
from slime_hydra.reward.math import deepscaler_reward, math_reward
from slime_hydra.reward.remote import RemoteReward, RemoteRewardError
from slime_hydra.reward.text import exact_match_reward, f1_reward, gpqa_reward, random_reward

RewardFn = Callable[[str, Any, dict], Any]

BUILTINS: dict[str, RewardFn] = {
    "math": math_reward, "deepscaler": deepscaler_reward, "dapo": dapo_reward, "f1": f1_reward,
    "gpqa": gpqa_reward, "exact_match": exact_match_reward, "random": random_reward,
}
NAMES = (*BUILTINS, "remote", "custom")
RULE_TIMEOUT_S = 10.0
"""Seconds one rule-reward call may take before it scores 0."""

__all__ = ["get_reward_fn", "group_reward", "RewardScorer", "RemoteRewardError", "NAMES"]


def group_reward(fn: Callable) -> Callable:
    """Mark fn(responses, labels, metadatas) -> list of rewards as scoring a whole group at once."""
    fn.group_reward = True
    return fn


def get_reward_fn(name: str, target: Optional[str] = None, **remote_options) -> RewardFn:
    """The reward function for reward.name (see the module docstring); remote_options go to RemoteReward."""
    if name in BUILTINS:
        return BUILTINS[name]
    if name == "remote":
        if not remote_options.get("url"):
            raise ValueError("reward.name=remote needs reward.url=http://host:port/path")
        return RemoteReward(**remote_options)
    if name == "custom":
        return _import_target(target)
    nearest = difflib.get_close_matches(name, NAMES, n=1)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"reward.name={name!r} is not a reward; choose one of {', '.join(NAMES)}{hint}")


def _import_target(target: Optional[str]) -> RewardFn:
    if not target:
        raise ValueError("reward.name=custom needs reward.target=<module.function>")
    module_name, _, attr = target.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"reward.target={target!r} cannot be imported ({type(error).__name__}: {error}); give a "
                         "dotted path module.function importable where the rollout runs") from error
    if not callable(fn):
        raise ValueError(f"reward.target={target!r} is not callable")
    return fn


class RewardScorer:
    """Scores groups concurrently with the configured reward (see the module docstring)."""

    def __init__(self, cfg: RewardConfig):
        remote = {"url": cfg.url, "timeout_s": cfg.timeout_s, "max_retries": cfg.max_retries,
                  "backoff_s": cfg.backoff_s} if cfg.name == "remote" else {}
        self.fn = get_reward_fn(cfg.name, cfg.target, **remote)
        self.is_group = bool(getattr(self.fn, "group_reward", False))
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None))
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="reward")
        self.max_concurrency = cfg.max_concurrency
        self._slots: Optional[asyncio.Semaphore] = None
        self.timeouts = 0

    async def _call(self, *args) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrency)
        async with self._slots:
            if self.is_async:
                return await self.fn(*args)
            future = asyncio.get_running_loop().run_in_executor(self.pool, self.fn, *args)
            try:
                return await asyncio.wait_for(future, RULE_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.timeouts += 1
                return 0.0

    async def score_group(self, responses: Sequence[str], labels: Sequence[Any],
                          metadatas: Sequence[dict]) -> list[Any]:
        """One reward per response, in order."""
        if self.is_group:
            rewards = await self._call(list(responses), list(labels), list(metadatas))
            if len(rewards) != len(responses):
                raise ValueError(f"group reward returned {len(rewards)} rewards for {len(responses)} responses")
            return list(rewards)
        return list(await asyncio.gather(*[self._call(r, l, m) for r, l, m in zip(responses, labels, metadatas)]))

    async def score_batch(self, groups: Sequence[tuple[Sequence[str], Sequence[Any], Sequence[dict]]]) -> list:
        """score_group over many groups at once."""
        return list(await asyncio.gather(*[self.score_group(*g) for g in groups]))
