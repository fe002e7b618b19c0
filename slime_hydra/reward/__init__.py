"""The reward hub: ``get_reward_fn(name)`` and the ``RewardScorer`` the rollout uses.

    fn = get_reward_fn("math")                 # fn(response, label, metadata) -> float | dict
    scorer = RewardScorer(cfg.reward)
    rewards = await scorer.score_group(responses, labels, metadatas)
    scalar_reward(rewards[0], cfg.reward.reward_key)  # the float advantages are computed from

Built-ins (reward.name), one module each: ``math`` and ``deepscaler`` (math.py), ``dapo``, ``f1``, ``gpqa``,
``exact_match``, ``task`` (the score of the environment that generated the row: data/tasks/), ``random``, and ``remote`` (remote.py: reward.url, timeout_s, max_retries, backoff_s).
``custom`` imports ``reward.target``, the dotted path of your ``fn(response, label, metadata)``.

A function marked ``@group_reward`` is called once per group instead:
``fn(responses, labels, metadatas) -> list[float | dict]`` (e.g. rewards ranked within the group).
Concurrency and timeouts: scorer.py.
"""

import importlib

_EXPORTS = {"NAMES": "registry", "get_reward_fn": "registry", "group_reward": "registry",
            "scalar_reward": "registry", "RemoteRewardError": "remote", "RewardScorer": "scorer"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Imported on first use: the config schema imports reward.config, and math-verify (sympy) is slow to load."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"slime_hydra.reward.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'slime_hydra.reward' has no attribute {name!r}")
