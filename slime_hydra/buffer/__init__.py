"""Samples, dynamic filters, and the rollout buffer with weight versions and a staleness bound."""

from slime_hydra.buffer.buffer import BufferBatch, Request, RolloutBuffer, Verdict
from slime_hydra.buffer.filters import NonzeroStd, apply_filter, get_filter
from slime_hydra.buffer.sample import Sample, Status, group_weight_version

__all__ = ["BufferBatch", "NonzeroStd", "Request", "RolloutBuffer", "Sample", "Status", "Verdict", "apply_filter",
           "get_filter", "group_weight_version"]
