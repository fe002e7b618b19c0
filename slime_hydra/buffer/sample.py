"""``Sample``: one response to one prompt, as it travels from the rollout through reward and buffer to the trainer.

A group is the ``n_samples_per_prompt`` samples that share a ``group_index`` (one prompt). Token layout::

    tokens = prompt ids (prompt_length of them) + response ids (response_length of them)
    loss_mask, rollout_log_probs: one entry per response token (rollout_log_probs may be empty when the engine did
    not return logprobs)

``routed_experts`` (MoE models, ``algo.routing_replay``) is the engine's routing of ``tokens``, as the newest /generate
answer reported it: each answer covers every position it ran (the whole sequence but its last token), so it replaces
the one before.

``weight_version`` is the policy version whose weights produced the sample's *first* response token; a partial
rollout resumed under newer weights keeps it, so staleness is measured from the oldest token.
"""

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Optional, Union

Prompt = Union[str, list[dict]]
Reward = Union[float, dict, None]


class Status(str, Enum):
    """Where a sample is in its life; the value is the string written to checkpoints."""

    PENDING = "pending"
    """Not (fully) generated yet; a recycled partial rollout is pending with a non-empty response."""
    COMPLETED = "completed"
    """Generation stopped on an end-of-sequence token or stop string."""
    TRUNCATED = "truncated"
    """Generation hit the response budget (rollout.max_response_tokens)."""
    ABORTED = "aborted"
    """Generation was cut off by the rollout (over-sampling finished early); partial output kept."""
    FAILED = "failed"
    """Generation or scoring raised; the sample is unusable."""


@dataclass
class Sample:
    """One prompt + response with everything the reward, the filters and the trainer read."""

    index: int = 0
    """Unique sample id within a run (group_index * n_samples_per_prompt + position in the group)."""
    group_index: int = 0
    """Id of the prompt group this sample belongs to; samples of one prompt share it."""
    prompt: Prompt = ""
    """The prompt as the dataset gave it: a string, or a list of {role, content} chat messages."""
    label: Any = None
    """Reference answer given to the reward function (any JSON value)."""
    metadata: dict = field(default_factory=dict)
    """Per-prompt extras given to the reward function (JSON-safe dict)."""
    tokens: list[int] = field(default_factory=list)
    """Prompt + response token ids."""
    response: str = ""
    """Decoded response text."""
    response_length: int = 0
    """Response tokens at the end of ``tokens``."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for response tokens the policy loss trains on, 0 for others (e.g. tool output); length response_length."""
    rollout_log_probs: list[float] = field(default_factory=list)
    """Engine logprob (natural log) of each response token; length response_length, or empty if not returned."""
    reward: Reward = None
    """Reward: a float, or a dict of named values (reward.reward_key picks the scalar); None before scoring."""
    weight_version: int = 0
    """Policy version that produced the first response token (meaningful once response_length > 0)."""
    routed_experts: str = ""
    """MoE models with algo.routing_replay: the experts the engine's routers chose for the first tokens of
    ``tokens`` (the latest /generate answer's ``meta_info.routed_experts``, slime_hydra/routed_experts.py: every
    position it ran, prompt and response); "" when the engine returned none."""
    status: Status = Status.PENDING
    """pending | completed | truncated | aborted | failed."""

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def prompt_length(self) -> int:
        """Prompt tokens at the start of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids."""
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        """The response's token ids."""
        return self.tokens[self.prompt_length:]

    @property
    def is_done(self) -> bool:
        """Generation finished normally (completed or truncated)."""
        return self.status in (Status.COMPLETED, Status.TRUNCATED)

    def scalar_reward(self, reward_key: Optional[str] = None) -> float:
        """The reward as one float: the float itself, or ``reward[reward_key]`` when the reward is a dict.

        Raises ValueError when the sample is unscored, or the reward is a dict and reward_key is missing from it.
        """
        if self.reward is None:
            raise ValueError(f"sample {self.index} (group {self.group_index}) has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None or reward_key not in self.reward:
                raise ValueError(f"sample {self.index}: the reward is a dict with keys {sorted(self.reward)}; "
                                 f"set reward.reward_key to the one holding the scalar (got {reward_key!r})")
            return float(self.reward[reward_key])
        return float(self.reward)

    def check(self) -> None:
        """Raise ValueError if the per-response-token lists disagree with response_length."""
        n = self.response_length
        problems = []
        if not 0 <= n <= len(self.tokens):
            problems.append(f"response_length={n} with {len(self.tokens)} tokens")
        if len(self.loss_mask) != n:
            problems.append(f"loss_mask has {len(self.loss_mask)} entries for response_length={n}")
        if self.rollout_log_probs and len(self.rollout_log_probs) != n:
            problems.append(f"rollout_log_probs has {len(self.rollout_log_probs)} entries for response_length={n}")
        if problems:
            raise ValueError(f"sample {self.index} (group {self.group_index}): " + "; ".join(problems))

    def to_dict(self) -> dict:
        """A JSON-safe dict (status as its string); ``Sample.from_dict`` inverts it."""
        out = asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        """The sample written by ``to_dict``; raises ValueError naming any key that is not a Sample field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"not Sample fields: {unknown}")
        return cls(**data)


def group_weight_version(group: list[Sample]) -> Optional[int]:
    """Oldest weight_version among the group's samples that have response tokens; None if none has any yet."""
    versions = [s.weight_version for s in group if s.response_length > 0]
    return min(versions) if versions else None
