"""Reward group schema: which reward function scores a response, and how it is called."""

from dataclasses import dataclass
from typing import Iterator, Optional

from slime_hydra.options import Problem, choice, non_negative, positive

REWARD_NAMES = ("math", "dapo", "deepscaler", "f1", "gpqa", "exact_match", "task", "random", "remote", "custom")
"""reward.name: the built-in reward functions (reward/registry.py), a reward server, or the user's function."""


@dataclass
class RewardConfig:
    name: str = choice("math", REWARD_NAMES)
    """Built-in reward (math | dapo | deepscaler | f1 | gpqa | exact_match | task: the environment's own score |
    random | remote) or custom."""
    target: Optional[str] = None
    """custom only: dotted path of fn(response, label, metadata) -> float | dict (or a group-level function)."""
    reward_key: Optional[str] = None
    """When the reward is a dict, the key holding the scalar used for advantages (e.g. score); null for floats."""
    url: Optional[str] = None
    """remote only: the reward server's URL (POST {response, label, metadata})."""
    timeout_s: float = positive(30.0)
    """Seconds one call may take: remote, per request (then retried); others, a call still running scores 0."""
    max_retries: int = non_negative(3)
    """remote only: attempts after the first failure before the run fails."""
    backoff_s: float = non_negative(1.0)
    """remote only: first retry delay in seconds; doubles each retry."""
    max_concurrency: int = positive(64)
    """Rewards computed at once (threads for rule rewards, requests for remote)."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.name == "custom" and not (self.target and "." in self.target):
            yield Problem((f"{prefix}target",), f"reward=custom needs a dotted path, got {self.target!r}",
                          f"set {prefix}target=my_pkg.rewards.score")
        if self.name == "remote" and not (self.url or "").startswith(("http://", "https://")):
            yield Problem((f"{prefix}url",), f"reward=remote needs an http(s) URL, got {self.url!r}",
                          f"set {prefix}url=http://host:port/score")
