"""``PromptSource``: prompts in epochs, in batches, with a cursor a checkpoint can save and restore.

Epoch e visits every record once, in the order ``order(e)``: a permutation drawn from a generator seeded with
(seed, e) when shuffling, else the records' own order. The cursor is (epoch, offset): the next prompt handed out is
``records[order(epoch)[offset]]``. Nothing else is state, so a source restored from ``state_dict()`` hands out
exactly the prompts an uninterrupted one would have.

A batch that reaches the end of an epoch is filled from the start of the next epoch, so every batch holds exactly
the number of prompts asked for and no prompt is skipped or repeated within an epoch (with 10 records and batches
of 4: batch 3 is the last 2 of epoch 0 then the first 2 of epoch 1, and the cursor ends at (1, 2)). A request for
more prompts than there are records spans several epochs, so it holds some prompts more than once.
"""

import random
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class PromptSource(Generic[T]):
    """Batches of ``batch_prompts`` records, epoch after epoch, forever (iterate it, or call next_batch/take)."""

    def __init__(self, records: Sequence[T], batch_prompts: int, shuffle: bool = True, seed: int = 0):
        """records: the prompts (e.g. PromptDataset.records); batch_prompts: prompts per next_batch();
        shuffle: reorder every epoch; seed: with the epoch number, fixes each epoch's order."""
        if not records:
            raise ValueError("PromptSource needs at least one record")
        if batch_prompts < 1:
            raise ValueError(f"batch_prompts={batch_prompts}: need at least 1 prompt per batch")
        self.records = records
        self.batch_prompts = batch_prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        """Current epoch (0-based)."""
        self.offset = 0
        """Position of the next prompt within the current epoch's order."""
        self._order = self.order(0)

    def order(self, epoch: int) -> list[int]:
        """Record indices in the order epoch ``epoch`` visits them."""
        indices = list(range(len(self.records)))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by random.Random: stable across runs and Python versions.
            random.Random(f"slime_hydra.PromptSource/{self.seed}/{epoch}").shuffle(indices)
        return indices

    @property
    def consumed(self) -> int:
        """Prompts handed out since the start (all epochs)."""
        return self.epoch * len(self.records) + self.offset

    def take(self, n: int) -> list[T]:
        """The next n prompts (n >= 0), crossing into the next epoch when this one runs out."""
        if n < 0:
            raise ValueError(f"cannot take {n} prompts")
        out = []
        while len(out) < n:
            step = min(n - len(out), len(self.records) - self.offset)
            out.extend(self.records[i] for i in self._order[self.offset: self.offset + step])
            self.offset += step
            if self.offset == len(self.records):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self.order(self.epoch)
        return out

    def next_batch(self) -> list[T]:
        """The next ``batch_prompts`` prompts."""
        return self.take(self.batch_prompts)

    def __iter__(self) -> "PromptSource[T]":
        return self

    def __next__(self) -> list[T]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """The cursor, JSON-safe; the seed, shuffle flag and record count are saved to check the resume."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_records": len(self.records)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor; raises ValueError if the records, seed or shuffle flag differ, since the
        saved position would then point at other prompts. batch_prompts may differ (the cursor counts prompts)."""
        if "num_records" not in state:
            raise ValueError("the checkpoint's prompt cursor is an adaptive sampler's, but data.adaptive.enabled="
                             "false; resume with the run's own data settings")
        mismatched = [f"{key}: saved {state[key]!r}, now {now!r}" for key, now in
                      (("num_records", len(self.records)), ("seed", self.seed), ("shuffle", self.shuffle))
                      if state[key] != now]
        if mismatched:
            raise ValueError("the prompt cursor does not match this dataset: " + "; ".join(mismatched))
        if not 0 <= state["offset"] < len(self.records) or state["epoch"] < 0:
            raise ValueError(f"invalid prompt cursor epoch={state['epoch']} offset={state['offset']}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self.order(self.epoch)
