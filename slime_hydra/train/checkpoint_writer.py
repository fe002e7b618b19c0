"""A trainer rank's checkpoint written in the background: the step waits only for a copy of the state in host memory.

    writer = CheckpointWriter()
    staged = writer.stage(state)               # host copies of every tensor (pinned on GPU machines)
    writer.start(ckpt_dir, write_a, write_b)   # a daemon thread runs the parts in order
    writer.finished()                          # None while writing, else the write's seconds; raises its error

Copies go through torch.distributed.checkpoint's ``DefaultStager`` (the staging that DCP's ``async_save`` does),
kept for the life of the rank: it reuses its host buffers from one save to the next (on GPU machines they are
pinned, so the copy runs at PCIe speed and is not pinned again each time), so host memory holds one more copy of
the staged state from the first background save on (config/memory.py counts it). Only one write runs at a time: the
next staging overwrites those buffers, so a save first waits for the previous write (``finished(wait=True)``).

The writing thread is written here rather than taken from DCP because train=fsdp also writes files DCP does not
(the per-rank RNG and reference file, trainer.json) after DCP's own background write, and train=megatron's
checkpoint is per-slot ``torch.save`` files, not DCP's format.
"""

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

HOLD_ENV = "SLIME_HYDRA_HOLD_CHECKPOINT_WRITE"
"""Tests only: a folder. A background write into it (or a folder under it) creates ``<folder>/held_<pid>``, then
waits until ``<folder>/release`` exists before its parts run, so a test can act (train on, kill the run) while a
write is provably in progress (train=fsdp: DCP's own thread writes ``dcp/`` meanwhile; the rest waits)."""


class CheckpointWriter:
    """One rank's background checkpoint writes, one at a time."""

    def __init__(self) -> None:
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self._thread: Optional[threading.Thread] = None
        self._dir: Optional[Path] = None
        self._seconds = self._began = 0.0
        self._error: Optional[BaseException] = None

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts, lists, tuples) whose tensors are host copies, complete on return."""
        return self.stager.stage(state)

    def start(self, ckpt_dir: str | Path, *parts: Callable[[], None]) -> None:
        """Run ``parts`` in order in a daemon thread (each writes and fsyncs its files from staged state). A daemon,
        so a rank that exits mid-write does not hang on it: the loop points ``latest`` only at finished writes."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"a background write of {self._dir} is still running: call finished(wait=True) "
                               "first")
        self._dir, self._error, self._began = Path(ckpt_dir), None, time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=parts, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def finished(self, wait: bool = False) -> Optional[float]:
        """Seconds the latest write took (from ``start``) once its files are on disk (0.0 when none was started); None while it is
        still writing, unless ``wait`` (block until it ends). Raises a RuntimeError for a write that failed."""
        if self._thread is None:
            return 0.0
        if wait:
            self._thread.join()
        elif self._thread.is_alive():
            return None
        if self._error is not None:
            raise RuntimeError(f"the background write of checkpoint {self._dir} failed") from self._error
        return self._seconds

    def _run(self, *parts: Callable[[], None]) -> None:
        try:
            _hold_for_test(self._dir)
            for part in parts:
                part()
            self._seconds = time.perf_counter() - self._began
        except BaseException as error:  # reported by finished(), in the loop's process
            self._error = error


def _hold_for_test(ckpt_dir: Path) -> None:
    folder = os.environ.get(HOLD_ENV)
    if not folder or not ckpt_dir.resolve().is_relative_to(Path(folder).resolve()):
        return
    (Path(folder) / f"held_{os.getpid()}").touch()
    while not (Path(folder) / "release").exists():
        time.sleep(0.05)
