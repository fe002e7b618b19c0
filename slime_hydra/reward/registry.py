"""Reward functions by name: ``get_reward_fn(reward.name, reward.target)``, ``@group_reward``, ``scalar_reward``."""

import difflib
import importlib
from typing import Any, Callable, Optional

from slime_hydra.dotted import import_callable
from slime_hydra.reward.config import REWARD_NAMES
from slime_hydra.reward.remote import RemoteReward

RewardFn = Callable[[str, Any, dict], Any]

BUILTINS: dict[str, str] = {
    "math": "slime_hydra.reward.math.math_reward", "dapo": "slime_hydra.reward.dapo.dapo_reward",
    "deepscaler": "slime_hydra.reward.math.deepscaler_reward", "f1": "slime_hydra.reward.f1.f1_reward",
    "gpqa": "slime_hydra.reward.gpqa.gpqa_reward", "exact_match": "slime_hydra.reward.exact_match.exact_match_reward",
    "task": "slime_hydra.data.tasks.task_reward", "random": "slime_hydra.reward.random.random_reward",
}
"""reward.name -> the built-in function's dotted path, imported when chosen: math-verify (sympy, ~1 s of CPU) loads
only in runs that score with it."""
NAMES = REWARD_NAMES
"""Every valid reward.name: the BUILTINS, remote and custom (reward/config.py)."""


def group_reward(fn: Callable) -> Callable:
    """Mark ``fn(responses, labels, metadatas) -> list[float | dict]`` as scoring a whole group in one call."""
    fn.group_reward = True
    return fn


def is_group_reward(fn: Callable) -> bool:
    return bool(getattr(fn, "group_reward", False))


def get_reward_fn(name: str, target: Optional[str] = None, **remote_options) -> RewardFn:
    """The reward function for reward.name: a built-in, ``remote`` (remote_options are RemoteReward's: url,
    timeout_s, max_retries, backoff_s) or ``custom`` (the function at the dotted path ``target``)."""
    if name in BUILTINS:
        module, fn = BUILTINS[name].rsplit(".", 1)
        return getattr(importlib.import_module(module), fn)
    if name == "remote":
        if not remote_options.get("url"):
            raise ValueError("reward.name=remote needs reward.url=http://host:port/path")
        return RemoteReward(**remote_options)
    if name == "custom":
        return _import_target(target)
    nearest = difflib.get_close_matches(str(name), NAMES, n=1, cutoff=0.0)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"reward.name={name!r} is not a reward; choose one of {', '.join(NAMES)}{hint}")


def _import_target(target: Optional[str]) -> RewardFn:
    if not target:
        raise ValueError("reward.name=custom needs reward.target=<module.function>")
    return import_callable(target, "reward.target", "fn(response, label, metadata)")


def scalar_reward(reward: Any, reward_key: Optional[str] = None) -> float:
    """The reward as one float: a number itself, or ``reward[reward_key]`` when the reward is a dict."""
    if isinstance(reward, dict):
        if reward_key is None or reward_key not in reward:
            raise KeyError(f"the reward is a dict with keys {sorted(reward)} and reward.reward_key={reward_key!r}; "
                           "set reward.reward_key to the key holding the scalar")
        return float(reward[reward_key])
    if reward is None:
        raise ValueError("the reward is None (not scored)")
    return float(reward)
