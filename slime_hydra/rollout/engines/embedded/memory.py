"""The embedded engine's releasable GPU memory: its weights and its KV cache, given back to the device while a
colocated trainer works and taken again at the same addresses, so the CUDA graphs and compiled steps that read them
stay valid across a release.

    memory = Releasable(device)
    with memory.region("weights"): ...                # what is allocated here is released with the tag
    memory.release(["weights", "kv_cache"])            # the physical memory is unmapped; the weights' bytes first
                                                       # go to a pinned host copy (kept for the next release)
    memory.writable(param)                             # while "weights" is released: where an update of param goes
    memory.resume(["weights", "kv_cache"])             # mapped again at the same virtual addresses, weights copied back

On CUDA the regions are torch_memory_saver's (the library SGLang and slime use for the same job): inside a region
torch allocates from a memory pool whose segments are CUDA virtual-memory mappings; a pause unmaps their physical
pages and keeps the address range. ``hook_mode="torch"`` (a torch ``MemPool`` with a pluggable allocator) needs no
``LD_PRELOAD`` of the engine process. The KV cache is released without a copy (no request is running then); the
CUDA graphs' own working memory (a step's activations, MiB) stays. Elsewhere (CPU) nothing is given back: the tags
are only marked, so the engine's protocol (no steps while released, updates land) behaves the same.

``place`` puts a model's parameters and buffers into one allocation, so the weights region holds exactly them.
"""

from contextlib import contextmanager
from functools import cache
from typing import Iterator, Sequence

import torch
from torch import nn

TAGS = ("weights", "kv_cache")
"""What a release gives back. (SGLang's third tag, ``cuda_graph``, is accepted by the server and keeps the graphs.)"""
_BACKED_UP = ("weights",)
"""Tags whose bytes survive a release (a host copy); the KV cache's do not need to."""
_ALIGN = 256
"""Byte alignment of each storage in ``place``'s allocation (the CUDA allocator's)."""


@cache
def _saver():
    """torch_memory_saver's process-wide instance, set to its in-process mode on first use."""
    from torch_memory_saver import torch_memory_saver

    torch_memory_saver.hook_mode = "torch"
    torch_memory_saver.retain_cpu_backup = True  # one pinned host copy, reused by every release
    return torch_memory_saver


class Releasable:
    """The engine's memory regions by tag and which of them are released now."""

    def __init__(self, device: torch.device):
        self.device = device
        self.saver = _saver() if device.type == "cuda" else None
        """torch_memory_saver (None: on the CPU, where nothing is given back)."""
        self.released: set[str] = set()

    @contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Allocations made in this block belong to ``tag`` (one of TAGS)."""
        if tag not in TAGS:
            raise ValueError(f"memory tag {tag!r} is not one of {TAGS}")
        if self.saver is None:
            yield
            return
        with torch.cuda.device(self.device), self.saver.region(tag, enable_cpu_backup=tag in _BACKED_UP):
            yield

    def release(self, tags: Sequence[str]) -> None:
        """Give back the memory of ``tags`` (those not released already). The device is synchronised first: no
        kernel may still read it."""
        for tag in [t for t in TAGS if t in tags and t not in self.released]:
            if self.saver is not None:
                torch.cuda.synchronize(self.device)
                with torch.cuda.device(self.device):
                    self.saver.pause(tag)
            self.released.add(tag)

    def resume(self, tags: Sequence[str]) -> None:
        """Take the memory of ``tags`` back (those released), at the same addresses; backed-up bytes restored."""
        for tag in [t for t in TAGS if t in tags and t in self.released]:
            if self.saver is not None:
                with torch.cuda.device(self.device):
                    self.saver.resume(tag)
            self.released.discard(tag)

    def writable(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where a write to ``tensor`` (of the weights region) goes now: its host copy while the weights are
        released (restored by ``resume``), else the tensor itself."""
        if "weights" in self.released and self.saver is not None:
            return self.saver.get_cpu_backup(tensor, zero_copy=True)
        return tensor


def place(module: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` into one new allocation on ``device``; tensors that share a
    storage (tied weights, stacked sibling projections' views) still share it there. Written here because
    ``Module.to`` moves each tensor on its own: views would become copies, and inside a memory region the storage it
    frees along the way would stay in the region, released and restored with the weights."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t is not None]
    offsets: dict[int, int] = {}  # storage address -> byte offset in the allocation
    storages = []
    size = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in offsets:
            offsets[storage.data_ptr()] = size
            storages.append(storage)
            size += -(-storage.nbytes() // _ALIGN) * _ALIGN
    whole = torch.empty(size, dtype=torch.uint8, device=device)
    for storage in storages:
        at = offsets[storage.data_ptr()]
        whole[at:at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
    for tensor in tensors:
        at = offsets[tensor.untyped_storage().data_ptr()] // tensor.element_size() + tensor.storage_offset()
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=device).set_(
            whole.untyped_storage(), at, tensor.shape, tensor.stride())
