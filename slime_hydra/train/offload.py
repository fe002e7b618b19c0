"""Trainer memory off the GPU while colocated engines generate (slime's offload), and back before training.

    moved = to_host(model, optimizer)      # parameters, buffers, optimizer state -> host; returns what moved
    to_device(model, optimizer, moved, device)

Backends get ``offload()`` / ``onload()`` from ``Offloadable`` (they need ``model``, ``optimizer``, ``device``).

Parameters and buffers move with ``module.to`` (an FSDP2 module re-registers its sharded parameters there);
optimizer state tensors that were on the GPU move one by one and come back to the same device, so the
optimizer's parameter references stay valid (``module.to`` keeps the Parameter objects). Copies are
``non_blocking``: a device-to-host copy then lands in pinned memory from torch's caching host allocator (reused
from one offload to the next), so both directions run at PCIe speed; one synchronize ends each move. Gradients are expected
to be freed already (``zero_grad(set_to_none=True)`` after every step). The CUDA cache is emptied afterwards so
the engines can take the memory.
"""

import torch

from slime_hydra.train.optim import local_states

ONLOAD_MARGIN = 1 << 30
"""Bytes of free device memory ``onload_fits`` keeps beyond the state it brings back (allocator rounding, the CUDA
context's own growth)."""


def to_host(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[dict, str]]:
    """Move the model and the optimizer's GPU state to the host; returns the (state dict, key) pairs moved."""
    model.to("cpu", non_blocking=True)
    moved = []
    for state in local_states(optimizer):  # ZeroRedundancyOptimizer: its shard's; optim.Partitioned: each part's
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_cuda:
                state[key] = value.to("cpu", non_blocking=True)
                moved.append((state, key))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return moved


def to_device(model: torch.nn.Module, optimizer: torch.optim.Optimizer, moved: list[tuple[dict, str]],
              device: torch.device) -> None:
    """Inverse of ``to_host``."""
    model.to(device, non_blocking=True)
    for state, key in moved:
        state[key] = state[key].to(device, non_blocking=True)
    torch.cuda.synchronize()


class Offloadable:
    """``offload`` / ``onload`` for a backend with ``self.model``, ``self.optimizer`` and ``self.device``."""

    _offloaded = None
    _offloaded_bytes = 0

    def offload(self) -> float:
        """Colocated GPUs: parameters and optimizer state to the host while engines generate. Returns the GPU
        bytes this process still holds (0 on CPU, where nothing moves)."""
        if self.device.type != "cuda":
            return 0.0
        if self._offloaded is None:
            held = torch.cuda.memory_allocated()
            self._offloaded = to_host(self.model, self.optimizer)
            self._offloaded_bytes = held - torch.cuda.memory_allocated()
        return float(torch.cuda.memory_allocated())

    def onload_fits(self) -> bool:
        """Whether ``onload`` fits the device's free memory now, with ``ONLOAD_MARGIN`` to spare (then it may run while
        colocated engines still release theirs: a release only adds free memory)."""
        if self.device.type != "cuda" or self._offloaded is None:
            return True
        return torch.cuda.mem_get_info(self.device)[0] >= self._offloaded_bytes + ONLOAD_MARGIN

    def peak_memory(self) -> float:
        """The most GPU memory torch allocated in this process since the last call (bytes; 0 on CPU)."""
        if self.device.type != "cuda":
            return 0.0
        peak = float(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return peak

    def onload(self) -> float:
        """Back on the GPU before training; returns the GPU bytes held."""
        if self.device.type != "cuda":
            return 0.0
        if self._offloaded is not None:
            to_device(self.model, self.optimizer, self._offloaded, self.device)
            self._offloaded = None
        return float(torch.cuda.memory_allocated())
