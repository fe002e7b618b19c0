"""Dynamic filters: decide, one finished group at a time, whether it is worth training on.

A filter is any callable ``fn(samples_of_one_group) -> bool | (bool, reason)``: True keeps the group; False (or
``(False, reason)``) drops it, and the buffer counts drops by reason (the filter's name when none is given).
``algo.dynamic_filter`` names one: ``nonzero_std`` or a dotted path ``my_pkg.filters.fn``.
"""

import statistics
from typing import Callable, Optional, Sequence, Union

from slime_hydra.buffer.sample import Sample
from slime_hydra.dotted import import_callable

FilterResult = Union[bool, tuple[bool, str]]
GroupFilter = Callable[[Sequence[Sample]], FilterResult]


class NonzeroStd:
    """DAPO's dynamic-sampling filter: keep a group only if its rewards are not all equal.

    A group whose rewards are all equal (all correct, or all wrong) gives every sample a zero group-relative
    advantage, hence no gradient. Rewards are read with ``Sample.scalar_reward(reward_key)``; a group of one
    sample has std 0 and is dropped.
    """

    reason = "zero_std"

    def __init__(self, reward_key: Optional[str] = None, min_std: float = 0.0):
        """reward_key: the dict key holding the scalar when rewards are dicts (reward.reward_key);
        min_std: keep the group only if the population std of its rewards exceeds this (reward units)."""
        self.reward_key = reward_key
        self.min_std = min_std

    def __call__(self, group: Sequence[Sample]) -> tuple[bool, str]:
        rewards = [s.scalar_reward(self.reward_key) for s in group]
        return statistics.pstdev(rewards) > self.min_std, self.reason


def get_filter(name: Optional[str], reward_key: Optional[str] = None) -> Optional[GroupFilter]:
    """The filter named by algo.dynamic_filter: None for none, ``nonzero_std``, or a dotted path to a callable."""
    if name is None:
        return None
    if name == "nonzero_std":
        return NonzeroStd(reward_key)
    if "." not in name:
        raise ValueError(f"algo.dynamic_filter={name!r} is neither nonzero_std nor a dotted path")
    return import_callable(name, "algo.dynamic_filter", "fn(group) -> bool | (bool, reason)")


def filter_name(fn: GroupFilter) -> str:
    """A readable name for a filter: its function name, or its class name for callable objects."""
    return getattr(fn, "__name__", type(fn).__name__)


def apply_filter(fn: GroupFilter, group: Sequence[Sample]) -> tuple[bool, str]:
    """Run one filter and normalise its answer to (keep, reason); raises TypeError on any other answer.

    The reason of a bare bool is the filter's name; numpy booleans count as booleans.
    """
    result = fn(group)
    keep, reason = result if isinstance(result, tuple) and len(result) == 2 else (result, filter_name(fn))
    is_bool = type(keep).__name__ in ("bool", "bool_")  # Python's bool, and numpy's (named bool_ before 2.0)
    if not is_bool or not isinstance(reason, str):
        raise TypeError(f"dynamic filter {filter_name(fn)} returned {result!r}; expected a bool or (bool, reason)")
    return bool(keep), reason
