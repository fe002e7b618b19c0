"""Reward group schema: which reward function scores a response, and how it is called."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class RewardConfig:
    name: str = "math"
    """Built-in reward (math | dapo | deepscaler | f1 | gpqa | remote | random | exact_match) or custom."""
    target: Optional[str] = None
    """custom only: dotted path of fn(response, label, metadata) -> float | dict (or a group-level function)."""
    reward_key: Optional[str] = None
    """When the reward is a dict, the key holding the scalar used for advantages (e.g. score); null for floats."""
    url: Optional[str] = None
    """remote only: the reward server's URL (POST {response, label, metadata})."""
    timeout_s: float = 30.0
    """Seconds one call may take: remote, per request (then retried); others, a call still running scores 0."""
    max_retries: int = 3
    """remote only: attempts after the first failure before the run fails."""
    backoff_s: float = 1.0
    """remote only: first retry delay in seconds; doubles each retry."""
    max_concurrency: int = 64
    """Rewards computed at once (threads for rule rewards, requests for remote)."""
