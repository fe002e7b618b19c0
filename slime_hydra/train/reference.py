"""The reference policy without a second device copy: host copies of this rank's shards, swapped in on demand.

    ref = host_copy(live)                    # at start: the initial weights, on the host
    with swapped_in(live, ref): forward()    # the reference forward; the trained shards are restored after

Host copies of CUDA tensors live in pinned memory from torch's caching host allocator (the one offload.py's moves
use), so every transfer of a swap is a non-blocking copy at PCIe speed rather than a pageable one; the swap's three
transfers (trained shards out, reference in, trained shards back) are queued on the current stream, whose order
keeps them correct without a synchronize.
"""

from contextlib import contextmanager

import torch


def _to_host(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies, queued (non-blocking, pinned) for CUDA tensors: readable on the host only after a sync."""
    return {name: t.detach().to("cpu", copy=True, non_blocking=t.is_cuda) for name, t in shards.items()}


def host_copy(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached host copies of the named tensors (pinned for CUDA tensors), complete on return."""
    copies = _to_host(shards)
    if any(t.is_cuda for t in shards.values()):
        torch.cuda.synchronize()
    return copies


def pinned(shards: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Host tensors (e.g. loaded from a checkpoint) in pinned memory when a GPU is present, else unchanged."""
    if shards is None or not torch.cuda.is_available():
        return shards
    return {name: t if t.is_pinned() else t.pin_memory() for name, t in shards.items()}


@contextmanager
def swapped_in(live: dict[str, torch.Tensor], shards: dict[str, torch.Tensor]):
    """Copy ``shards`` into the live parameter tensors for the duration of the block, then restore them."""
    trained = _to_host(live)
    with torch.no_grad():
        for name, ref in shards.items():
            live[name].copy_(ref, non_blocking=True)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, mine in trained.items():
                live[name].copy_(mine, non_blocking=True)
