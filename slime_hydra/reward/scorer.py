"""``RewardScorer``: scores groups of responses concurrently so a slow verifier does not serialise the rollout.

Plain functions (the rule rewards, a sync custom function) run in a thread pool of ``reward.max_concurrency``
threads; ``async def`` functions (remote, an async custom function) run on the event loop; in both cases at most
``max_concurrency`` calls are in flight. A function marked ``@group_reward`` is called once per group.

A sync call still running after ``reward.timeout_s`` scores 0.0 (every response of the group for a group reward),
is counted in ``timeouts`` and logged: Python cannot stop a thread, and math-verify's own SIGALRM timeouts do not
work outside the main thread. The stuck thread keeps its pool slot until it returns.
"""

import asyncio
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from slime_hydra.reward.config import RewardConfig
from slime_hydra.reward.registry import get_reward_fn, is_group_reward

log = logging.getLogger(__name__)

Group = tuple[Sequence[str], Sequence[Any], Sequence[dict]]


class RewardScorer:
    """Scores groups with the reward that ``cfg`` names (see the module docstring)."""

    def __init__(self, cfg: RewardConfig):
        remote = {"url": cfg.url, "timeout_s": cfg.timeout_s, "max_retries": cfg.max_retries,
                  "backoff_s": cfg.backoff_s} if cfg.name == "remote" else {}
        self.fn = get_reward_fn(cfg.name, cfg.target, **remote)
        self.name = getattr(self.fn, "__name__", type(self.fn).__name__)
        """The reward function's name, for reports."""
        self.is_group = is_group_reward(self.fn)
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None))
        self.timeout_s = cfg.timeout_s
        self.max_concurrency = cfg.max_concurrency
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="reward")
        self.timeouts = 0
        """Sync reward calls that ran past timeout_s and scored 0."""
        self._slots: Optional[asyncio.Semaphore] = None
        self._slots_loop: Optional[asyncio.AbstractEventLoop] = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots_loop is not loop:  # a semaphore belongs to one event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._slots

    async def _call(self, *args) -> Any:
        async with self._semaphore():
            if self.is_async:
                return await self.fn(*args)
            future = asyncio.get_running_loop().run_in_executor(self.pool, self.fn, *args)
            try:
                return await asyncio.wait_for(future, self.timeout_s)
            except asyncio.TimeoutError:
                self.timeouts += 1
                log.warning("reward %s took over reward.timeout_s=%s s; scored 0 (%d timeouts so far)",
                            getattr(self.fn, "__name__", self.fn), self.timeout_s, self.timeouts)
                return [0.0] * len(args[0]) if self.is_group else 0.0

    async def score_group(self, responses: Sequence[str], labels: Sequence[Any],
                          metadatas: Sequence[dict]) -> list[Any]:
        """One reward (float or dict) per response, in order."""
        if not len(responses) == len(labels) == len(metadatas):
            raise ValueError(f"score_group got {len(responses)} responses, {len(labels)} labels and "
                             f"{len(metadatas)} metadatas")
        if self.is_group:
            rewards = list(await self._call(list(responses), list(labels), list(metadatas)))
            if len(rewards) != len(responses):
                raise ValueError(f"group reward {getattr(self.fn, '__name__', self.fn)} returned {len(rewards)} "
                                 f"rewards for {len(responses)} responses")
            return rewards
        return list(await asyncio.gather(*(self._call(r, l, m) for r, l, m in zip(responses, labels, metadatas))))

    async def score_batch(self, groups: Sequence[Group]) -> list[list[Any]]:
        """score_group over many (responses, labels, metadatas) groups at once."""
        return list(await asyncio.gather(*(self.score_group(*g) for g in groups)))

    async def close(self) -> None:
        """Release the thread pool and, for remote, the HTTP session."""
        if hasattr(self.fn, "close"):
            await self.fn.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
