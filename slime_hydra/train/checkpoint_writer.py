"""A trainer rank's checkpoint written in the background: the step waits only for a copy of the state in host memory.

    writer = CheckpointWriter()
    staged = writer.stage(state)               # host copies of every tensor (pinned on GPU machines)
    writer.start(ckpt_dir, write_a, write_b)   # a daemon thread runs the parts in order
    writer.finished()                          # None while writing, else the write's seconds; raises its error

Copies go into host buffers kept for the life of the rank (pinned on GPU machines, so the copy runs at PCIe speed
and is not pinned again each time), one per tensor of the state, made again only when the state's structure, shapes
or dtypes change: host memory holds one more copy of the staged state from the first background save on
(config/memory.py counts it). Only one write runs at a time: the next staging overwrites those buffers, so a save
first waits for the previous write (``finished(wait=True)``).

Written here rather than taken from torch.distributed.checkpoint: its ``DefaultStager`` cannot stage twice in torch
2.11 (its ``_stage`` closes the inner stager, whose copy table is then empty: ``KeyError: <class 'type'>`` at the
second save, pytorch/pytorch#183413), and ``BlockingAsyncStager``'s kept buffers need a GPU to pin and refuse
NumPy's RNG state. The writer is itself the ``async_stager`` that train=fsdp hands to DCP's ``async_save``
(``stage`` and a ``close`` that keeps the buffers). The writing thread is ours because train=fsdp also writes files
DCP does not (the per-rank RNG and reference file, trainer.json) after DCP's own background write, and
train=megatron's checkpoint is per-slot ``torch.save`` files, not DCP's format.
"""

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

HOLD_ENV = "SLIME_HYDRA_HOLD_CHECKPOINT_WRITE"
"""Tests only: a folder. A background write into it (or a folder under it) creates ``<folder>/held_<pid>``, then
waits until ``<folder>/release`` exists before its parts run, so a test can act (train on, kill the run) while a
write is provably in progress (train=fsdp: DCP's own thread writes ``dcp/`` meanwhile; the rest waits)."""


class CheckpointWriter:
    """One rank's background checkpoint writes, one at a time."""

    should_synchronize_after_execute = False  # DCP's AsyncStager protocol: ``stage`` returns a finished copy

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._layout: Any = None  # the staged state's structure and its tensors' shapes and dtypes
        self._buffers: list[Optional[torch.Tensor]] = []
        self._thread: Optional[threading.Thread] = None
        self._dir: Optional[Path] = None
        self._seconds = self._began = 0.0
        self._error: Optional[BaseException] = None

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts, lists, tuples) whose tensors are host copies, complete on return: a
        DTensor becomes a DTensor of the same mesh and placements over a host copy of its local shard; other values
        are deep-copied."""
        leaves, spec = tree_flatten(state)
        locals_ = [leaf.to_local() if isinstance(leaf, DTensor) else leaf for leaf in leaves]
        layout = (spec, [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in locals_])
        if layout != self._layout:
            self._layout = layout
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self._cuda)
                             if isinstance(t, torch.Tensor) else None for t in locals_]
        staged = []
        for leaf, local, buffer in zip(leaves, locals_, self._buffers):
            if buffer is None:
                staged.append(copy.deepcopy(leaf))
                continue
            buffer.copy_(local, non_blocking=self._cuda and local.is_cuda)
            staged.append(DTensor.from_local(buffer, leaf.device_mesh, leaf.placements, run_check=False,
                                             shape=leaf.shape, stride=leaf.stride())
                          if isinstance(leaf, DTensor) else buffer)
        if self._cuda:
            torch.cuda.synchronize()
        return tree_unflatten(staged, spec)

    def synchronize_staging(self) -> None:
        """DCP's AsyncStager protocol: nothing to wait for, ``stage`` returns a finished copy."""

    def close(self) -> None:
        """DCP's AsyncStager protocol: the buffers are kept for the next save."""

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
