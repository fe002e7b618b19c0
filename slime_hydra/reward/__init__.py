"""The reward hub: ``get_reward_fn(name)`` and the ``RewardScorer`` the rollout uses.

    fn = get_reward_fn("math")                 # fn(response, label, metadata) -> float | dict
    scorer = RewardScorer(cfg.reward)
    rewards = await scorer.score_group(responses, labels, metadatas)
    scalar_reward(rewards[0], cfg.reward.reward_key)  # the float advantages are computed from

Built-ins (reward.name), one module each: ``math`` and ``deepscaler`` (math.py), ``dapo``, ``f1``, ``gpqa``,
``exact_match``, ``random``, and ``remote`` (remote.py: reward.url, timeout_s, max_retries, backoff_s).
``custom`` imports ``reward.target``, the dotted path of your ``fn(response, label, metadata)``.

A function marked ``@group_reward`` is called once per group instead:
``fn(responses, labels, metadatas) -> list[float | dict]`` (e.g. rewards ranked within the group).
Concurrency and timeouts: scorer.py.
"""

from slime_hydra.reward.registry import NAMES, get_reward_fn, group_reward, scalar_reward
from slime_hydra.reward.remote import RemoteRewardError
from slime_hydra.reward.scorer import RewardScorer

__all__ = ["NAMES", "get_reward_fn", "group_reward", "scalar_reward", "RewardScorer", "RemoteRewardError"]
