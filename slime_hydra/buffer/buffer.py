"""``RolloutBuffer``: finished groups in, full training batches out, with dynamic sampling and partial rollouts.

Unit of everything here: the group (the ``n_samples_per_prompt`` samples of one prompt, sharing group_index).

One training batch of B groups (``batch_prompts``) is collected in rounds::

    while (req := buffer.request(B, over_sampling_batch_prompts)) is not None:
        groups = req.resume + buffer.new_groups(source.take(req.new_prompts))
        for each group as it finishes generating and is scored:
            buffer.add_group(group)
            if buffer.enough(B): abort the groups still running, and add_group() each of them too
    batch = buffer.take_batch(B)

Where a group goes when it is added (``add_group`` returns which, as a ``Verdict``):

- any sample failed -> dropped (counted ``failed``);
- any sample aborted or pending -> recycled: its aborted samples become pending again, with their partial
  tokens, response and logprobs kept, and the group waits in the pending queue; the next ``request`` hands
  pending groups out before asking for new prompts, those with partial responses first (their tokens age with
  every weight update), otherwise in arrival order, so the generator resumes them (samples already completed
  stay completed). With ``recycle_aborted=False`` such groups are dropped (counted ``aborted_discarded``);
- too old (see staleness) -> dropped (counted ``stale``);
- the filters run in order; the first that rejects the group sends it to the reserve (counted
  ``filtered/<reason>``); a group every filter accepts is kept (counted ``kept``).

Over-sampling (rollout.over_sampling_batch_prompts): a round asks for
``ceil(deficit * over_sampling_batch_prompts / batch_prompts)`` groups, deficit being the groups still missing, so
round 1 asks for exactly over_sampling_batch_prompts and later rounds scale down.

Fallback when too few pass: after ``max_attempts`` rounds, ``request`` stops as soon as kept + reserve can fill
the batch, and ``take_batch`` tops the kept groups up with reserve groups (oldest first, counted ``topped_up``),
so training always gets B groups. While even the reserve cannot fill it, rounds go on; a round after
``max_attempts`` that finished no group at all raises, since more of the same would loop forever. The reserve
is emptied by every ``take_batch``: a filtered group is only ever used in the batch of its own step.

Staleness: a group's version is the oldest ``weight_version`` among its samples that have response tokens (a
group with none is never stale). With ``max_staleness`` = S, a group is dropped (counted ``stale``) when its
version < current - S, current being the version set by ``set_weight_version``: at that call for the groups
already held (kept, reserve, pending), and on arrival for groups added later. So every group that
``take_batch`` returns is within the bound.

Counters (``totals``, and per step in ``BufferBatch.counts``), in groups except ``rounds``: ``finished`` (reached
the filters), ``kept``, ``filtered/<reason>``, ``failed``, ``recycled``, ``aborted_discarded``, ``stale``,
``topped_up``, ``trained`` (groups returned by take_batch) and ``rounds`` (requests answered).
``state_dict()`` is JSON-safe: the kept, reserve and pending groups, the counters, the round count of the step
in progress, the current weight version and the next group index.
"""

import copy
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Optional, Sequence

from slime_hydra.buffer.filters import GroupFilter, apply_filter
from slime_hydra.buffer.sample import Sample, Status, group_weight_version

Group = list[Sample]


class Verdict(str, Enum):
    """What ``add_group`` did with a group."""

    KEPT = "kept"
    """Passed every filter; waits for take_batch."""
    FILTERED = "filtered"
    """Rejected by a filter; held in the reserve for the fallback top-up."""
    RECYCLED = "recycled"
    """Unfinished (aborted or pending samples); queued to be resumed by a later round."""
    DISCARDED = "discarded"
    """Dropped: a sample failed, or it was unfinished and recycling is off."""
    STALE = "stale"
    """Dropped: older than the staleness bound."""


@dataclass
class Request:
    """One round of generation: resume these groups first, then start new_prompts fresh ones."""

    resume: list[Group]
    """Recycled groups whose pending samples should be generated (continuing their partial responses)."""
    new_prompts: int
    """Fresh prompts to draw from the prompt source (each becomes a new group via RolloutBuffer.new_groups)."""
    round: int
    """1-based round number within the current training batch."""


@dataclass
class BufferBatch:
    """The groups of one training step and what it took to collect them."""

    groups: list[Group]
    """batch_prompts groups: kept ones (oldest first), then any reserve groups used as top-up."""
    topped_up: int
    """How many of ``groups`` (the last ones) failed a filter and were added by the fallback."""
    rounds: int
    """Rounds of generation this step took."""
    counts: dict[str, int] = field(default_factory=dict)
    """This step's counters (same keys as RolloutBuffer.totals)."""

    @property
    def samples(self) -> list[Sample]:
        """All samples, group after group."""
        return [s for g in self.groups for s in g]


class RolloutBuffer:
    """Collects finished groups until a training batch is full (see the module docstring for the protocol).

    Not thread-safe: call it from one thread (the rollout's event loop).
    """

    def __init__(self, n_samples_per_prompt: int, filters: Sequence[GroupFilter] = (), max_attempts: int = 3,
                 max_staleness: Optional[int] = None, recycle_aborted: bool = True):
        """n_samples_per_prompt: samples in every group; filters: dynamic filters, run in order;
        max_attempts: rounds per batch before falling back to filtered-out groups (>= 1);
        max_staleness: weight versions a group may lag behind the current one (None: no bound);
        recycle_aborted: resume aborted groups later (rollout.partial_rollout) instead of dropping them."""
        if n_samples_per_prompt < 1 or max_attempts < 1:
            raise ValueError(f"need n_samples_per_prompt >= 1 and max_attempts >= 1, got {n_samples_per_prompt} "
                             f"and {max_attempts}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0 (or None for no bound)")
        self.n_samples_per_prompt = n_samples_per_prompt
        self.filters = list(filters)
        self.max_attempts = max_attempts
        self.max_staleness = max_staleness
        self.recycle_aborted = recycle_aborted
        self.weight_version = 0
        """Current policy version (set_weight_version); staleness is measured against it."""
        self.totals: Counter = Counter()
        """Counters since the run started (restored by load_state_dict)."""
        self._kept: list[Group] = []
        self._reserve: list[Group] = []
        self._pending: deque[Group] = deque()
        self._next_group_index = 0
        self._step: Counter = Counter()
        self._rounds = 0
        self._finished_at_last_request = 0

    @property
    def num_kept(self) -> int:
        """Groups that passed the filters and wait for take_batch."""
        return len(self._kept)

    @property
    def num_reserve(self) -> int:
        """Filtered-out groups of this step, available for the fallback top-up."""
        return len(self._reserve)

    @property
    def num_pending(self) -> int:
        """Recycled (aborted) groups waiting to be resumed."""
        return len(self._pending)

    def enough(self, batch_prompts: int) -> bool:
        """True once batch_prompts groups have passed: the caller may abort the groups still generating."""
        return len(self._kept) >= batch_prompts

    def new_groups(self, records: Iterable) -> list[Group]:
        """One group of n_samples_per_prompt pending samples per prompt record, with fresh group indices.

        A record needs .prompt, .token_ids, .label, .metadata and .tools (data.PromptRecord); tools, when not
        None, are put in each sample's metadata under "tools" for generate hooks.
        """
        groups = []
        for record in records:
            g = self._next_group_index
            self._next_group_index += 1
            metadata = dict(record.metadata)
            if record.tools is not None:
                metadata["tools"] = record.tools
            groups.append([
                Sample(index=g * self.n_samples_per_prompt + j, group_index=g, prompt=copy.deepcopy(record.prompt),
                       label=copy.deepcopy(record.label), metadata=copy.deepcopy(metadata),
                       tokens=list(record.token_ids))
                for j in range(self.n_samples_per_prompt)])
        return groups

    def set_weight_version(self, version: int) -> int:
        """Make ``version`` current and drop the held groups it makes stale; returns how many were dropped."""
        if version < self.weight_version:
            raise ValueError(f"weight version went back from {self.weight_version} to {version}")
        self.weight_version = version
        dropped = 0
        for name in ("_kept", "_reserve", "_pending"):
            held = getattr(self, name)
            fresh = [g for g in held if not self._is_stale(g)]
            dropped += len(held) - len(fresh)
            setattr(self, name, deque(fresh) if name == "_pending" else fresh)
        self._count("stale", dropped)
        return dropped

    def add_group(self, samples: Sequence[Sample]) -> Verdict:
        """Hand back one group after generation and scoring (or after an abort); see the module docstring."""
        group = self._check_group(samples)
        statuses = {s.status for s in group}
        if Status.FAILED in statuses:
            self._count("failed")
            return Verdict.DISCARDED
        if statuses & {Status.ABORTED, Status.PENDING}:
            if not self.recycle_aborted:
                self._count("aborted_discarded")
                return Verdict.DISCARDED
            for s in group:
                if s.status is Status.ABORTED:
                    s.status = Status.PENDING
            self._pending.append(group)
            self._count("recycled")
            return Verdict.RECYCLED
        if self._is_stale(group):
            self._count("stale")
            return Verdict.STALE
        self._count("finished")
        for fn in self.filters:
            keep, reason = apply_filter(fn, group)
            if not keep:
                self._reserve.append(group)
                self._count(f"filtered/{reason}")
                return Verdict.FILTERED
        self._kept.append(group)
        self._count("kept")
        return Verdict.KEPT

    def request(self, batch_prompts: int, over_sampling_batch_prompts: Optional[int] = None) -> Optional[Request]:
        """The next round to generate for a batch of batch_prompts groups, or None when take_batch can fill it.

        over_sampling_batch_prompts: groups asked for in the first round (>= batch_prompts; None: batch_prompts).
        Raises RuntimeError when a round past max_attempts finished no group and the batch still cannot be filled.
        """
        over = batch_prompts if over_sampling_batch_prompts is None else over_sampling_batch_prompts
        if batch_prompts < 1 or over < batch_prompts:
            raise ValueError(f"need 1 <= batch_prompts <= over_sampling_batch_prompts, got {batch_prompts} and {over}")
        deficit = batch_prompts - len(self._kept)
        if deficit <= 0:
            return None
        if self._rounds >= self.max_attempts:
            if len(self._kept) + len(self._reserve) >= batch_prompts:
                return None
            if self._step["finished"] == self._finished_at_last_request:
                raise RuntimeError(
                    f"round {self._rounds} finished no group and the batch is still short: {len(self._kept)} kept "
                    f"+ {len(self._reserve)} filtered of {batch_prompts} needed; this step: {dict(self._step)}")
        size = math.ceil(deficit * over / batch_prompts)
        order = sorted(self._pending, key=lambda g: not any(s.response_length for s in g))  # stable: arrival order
        resume, self._pending = order[:size], deque(order[size:])
        self._rounds += 1
        self._count("rounds")
        self._finished_at_last_request = self._step["finished"]
        return Request(resume, size - len(resume), self._rounds)

    def take_batch(self, batch_prompts: int, by_index: bool = False) -> BufferBatch:
        """The oldest batch_prompts kept groups, topped up from the reserve if short; starts the next step. by_index
        (deterministic=true): oldest by group index, and the batch in that order; else in the order they finished.

        Call it once request() returns None. Kept groups beyond batch_prompts stay for the next step; the reserve
        is emptied. Raises RuntimeError (changing nothing) when even the reserve cannot fill the batch.
        """
        short = batch_prompts - min(batch_prompts, len(self._kept))
        if short > len(self._reserve):
            raise RuntimeError(f"cannot fill a batch of {batch_prompts} groups: {len(self._kept)} kept + "
                               f"{len(self._reserve)} filtered; call request() until it returns None first")
        if by_index:
            self._kept.sort(key=lambda g: g[0].group_index)
            self._reserve.sort(key=lambda g: g[0].group_index)
        groups = self._kept[:batch_prompts] + self._reserve[:short]
        self._kept = self._kept[batch_prompts:]
        self._reserve = []
        self._count("topped_up", short)
        self._count("trained", batch_prompts)
        batch = BufferBatch(groups, short, self._rounds, dict(self._step))
        self._step, self._rounds, self._finished_at_last_request = Counter(), 0, 0
        return batch

    def state_dict(self) -> dict:
        """Everything held, JSON-safe (samples via Sample.to_dict); filters are configuration, not state."""
        def dump(groups):
            return [[s.to_dict() for s in g] for g in groups]

        return {"n_samples_per_prompt": self.n_samples_per_prompt, "weight_version": self.weight_version,
                "next_group_index": self._next_group_index, "kept": dump(self._kept),
                "reserve": dump(self._reserve), "pending": dump(self._pending), "totals": dict(self.totals),
                "step": dict(self._step), "rounds": self._rounds,
                "finished_at_last_request": self._finished_at_last_request}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved; raises ValueError if n_samples_per_prompt differs."""
        if state["n_samples_per_prompt"] != self.n_samples_per_prompt:
            raise ValueError(f"the saved buffer holds groups of {state['n_samples_per_prompt']} samples, this one "
                             f"expects {self.n_samples_per_prompt} (rollout.n_samples_per_prompt changed?)")

        def load(groups):
            return [[Sample.from_dict(s) for s in g] for g in groups]

        self.weight_version = state["weight_version"]
        self._next_group_index = state["next_group_index"]
        self._kept, self._reserve = load(state["kept"]), load(state["reserve"])
        self._pending = deque(load(state["pending"]))
        self.totals, self._step = Counter(state["totals"]), Counter(state["step"])
        self._rounds = state["rounds"]
        self._finished_at_last_request = state["finished_at_last_request"]

    def _count(self, key: str, n: int = 1) -> None:
        if n:
            self.totals[key] += n
            self._step[key] += n

    def _is_stale(self, group: Group) -> bool:
        version = group_weight_version(group)
        return (self.max_staleness is not None and version is not None
                and version < self.weight_version - self.max_staleness)

    def _check_group(self, samples: Sequence[Sample]) -> Group:
        group = list(samples)
        if len(group) != self.n_samples_per_prompt:
            raise ValueError(f"a group has {len(group)} samples, expected n_samples_per_prompt="
                             f"{self.n_samples_per_prompt}")
        indices = {s.group_index for s in group}
        if len(indices) != 1:
            raise ValueError(f"samples of one group must share group_index, got {sorted(indices)}")
        return group
