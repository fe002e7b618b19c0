"""What a batch of samples says, as rollout metrics: rewards and their parts, the generate hooks' counters, and
what counts as correct (the rollout manager's batch and eval metrics)."""

import math
import statistics
from typing import Optional

from slime_hydra.buffer.sample import Sample


def reward_extras(samples: list[Sample], reward_key: Optional[str]) -> dict[str, float]:
    """``rollout/reward/<key>``: the mean of every numeric entry of dict rewards other than reward.reward_key (a
    reward may return its parts: {"score": 1.0, "format": 0.5, "length_penalty": -0.1}), over the samples that have
    it. Booleans count as 0/1; other values are left out."""
    sums: dict[str, list[float]] = {}
    for sample in samples:
        if isinstance(sample.reward, dict):
            for key, value in sample.reward.items():
                if key != reward_key and isinstance(value, (int, float)) and math.isfinite(value):
                    sums.setdefault(str(key), []).append(float(value))
    return {f"rollout/reward/{key}": statistics.fmean(values) for key, values in sorted(sums.items())}


def hook_counters(samples: list[Sample]) -> dict[str, float]:
    """``rollout/masked_tokens``: response tokens per sample the policy is not trained on (loss_mask 0: tool output,
    injected text); ``rollout/metadata/<key>``: the mean of every numeric metadata entry over the samples that have
    it (a hook's counters, e.g. the calculator's ``tool_calls`` and ``tool_errors``; a row's numeric fields)."""
    out = {"rollout/masked_tokens": statistics.fmean(s.loss_mask.count(0) for s in samples)} if samples else {}
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.metadata.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(str(key), []).append(float(value))
    return out | {f"rollout/metadata/{key}": statistics.fmean(v) for key, v in sorted(values.items())}


def is_correct(sample: Sample, reward_key: Optional[str]) -> bool:
    """The reward says correct: a dict's ``acc`` when present, else scalar reward >= 1."""
    if isinstance(sample.reward, dict) and "acc" in sample.reward:
        return bool(sample.reward["acc"])
    return sample.scalar_reward(reward_key) >= 1.0
