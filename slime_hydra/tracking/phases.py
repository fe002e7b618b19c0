"""The phases of one loop step and their times: ``perf/<phase>_time`` (seconds), written in one place.

    timer = StepTimer()
    with timer.phase("train"):
        ...
    metrics.update(timer.metrics(tokens))  # perf/<phase>_time, perf/step_time, perf/overhead_time, the step's rate

A phase entered twice in a step adds up (colocated runs move memory before the rollout, the training and the
sync: one ``offload`` time). ``perf/overhead_time`` is the step time outside every phase (Ray calls, batch
assembly, tracking). The progress line and the report read ``PHASES``, so they show what the loop times.
"""

import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("rollout", "offload", "logprobs", "teacher", "train", "weight_sync", "eval", "checkpoint")
"""What loop.py times, in the order a step runs them: the rollout (the loop's wait for a scored batch; in async
mode only the part training did not hide), colocated memory moves, old/ref logprobs (+ values), the teacher's
logprobs (on-policy distillation), the optimizer steps, the weight sync, eval, the checkpoint."""

WAITS_ON = {
    "rollout": "the rollout manager (RolloutManager.generate_batch)",
    "offload": "the trainer ranks and the engines to move GPU memory (offload / onload, release / resume)",
    "logprobs": "the trainer ranks (TrainRank.logprobs)",
    "teacher": "the trainer ranks (TrainRank.logprobs of the teacher they hold)",
    "train": "the trainer ranks (TrainRank.train_step)",
    "weight_sync": "the trainer ranks and the engines (the weight sync)",
    "eval": "the rollout manager (RolloutManager.evaluate); algo=sft: then the trainer ranks (the held-out loss)",
    "checkpoint": "the trainer ranks (saving, a background write), the rollout manager, the driver's checksums",
    None: "nobody: the driver itself works between phases",
}
"""Whom loop.py's driver waits on in each phase, for the stall doctor's report (Session.waits_on)."""


class StepTimer:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.times: dict[str, float] = {}
        self.current: str | None = None
        """The phase running now (None between phases)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (one of PHASES)."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        began, self.current = time.monotonic(), name
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.monotonic() - began
            self.current = None

    def metrics(self, tokens: float | None = None) -> dict[str, float]:
        """perf/<phase>_time of every phase entered, perf/step_time (since the timer was made),
        perf/overhead_time (step time outside the phases) and, given the step's response tokens,
        perf/step_tokens_per_s = tokens / perf/step_time: the whole step's rate, where the rollout manager's
        perf/tokens_per_s is the generation's alone (tokens / the time the batch took to generate)."""
        step = time.monotonic() - self.start
        out = {f"perf/{name}_time": seconds for name, seconds in self.times.items()}
        out["perf/step_time"] = step
        out["perf/overhead_time"] = step - sum(self.times.values())
        if tokens is not None:
            out["perf/step_tokens_per_s"] = tokens / max(step, 1e-9)
        return out
