"""Trainer memory off the GPU while colocated engines generate (slime's offload), and back before training.

    backend.start_offload()   # after training: the optimizer state starts for the host on a side stream (the weight
                              # sync that follows reads only the parameters)
    backend.offload()         # parameters and buffers to the host, the optimizer state's copies end; CUDA cache emptied
    backend.onload()          # parameters back (waited for); the optimizer state's copies start on the side stream
    ...logprobs...            # forward passes run while the optimizer state arrives
    backend.train_step(...)   # waits for it before the optimizer step (``_optimizer_state_ready``)

Backends get these from ``Offloadable`` (they need ``model``, ``optimizer``, ``device``) and call
``_optimizer_state_ready`` before anything reads the optimizer state (a checkpoint) or writes it (the optimizer step,
``to_write=True``).

Parameters and buffers move with ``module.to`` on the current stream (an FSDP2 module re-registers its sharded
parameters there); their copies end before ``offload`` / ``onload`` return. Optimizer state tensors that were on the
GPU move one by one on a side stream and come back to the same device, so the optimizer's parameter references stay
valid (``module.to`` keeps the Parameter objects). Adam's two moments are two thirds of the trainer's state (fp32
masters + m + v: 12 bytes a parameter), so leaving their copies in flight takes that share of the PCIe traffic off
the colocated switch: it runs beside the engines' resume and the weight sync on the way out, and beside the logprob
passes on the way back. Copies are ``non_blocking``: a device-to-host copy lands in pinned memory from torch's
caching host allocator (reused from one offload to the next), so both directions run at PCIe speed. Gradients are
expected to be freed already (``zero_grad(set_to_none=True)`` after every step).
"""

import torch

from slime_hydra.train.optim import local_states

ONLOAD_MARGIN = 1 << 30
"""Bytes of free device memory ``onload_fits`` keeps beyond the state it brings back (allocator rounding, the CUDA
context's own growth)."""


def _gpu_state(optimizer: torch.optim.Optimizer | None) -> list[tuple[dict, str]]:
    """The (state dict, key) of every optimizer state tensor this rank holds on the GPU (ZeroRedundancyOptimizer: its
    shard's; optim.Partitioned: each part's; none for a frozen teacher's None)."""
    if optimizer is None:
        return []
    return [(state, key) for state in local_states(optimizer) for key, value in state.items()
            if torch.is_tensor(value) and value.is_cuda]


class Offloadable:
    """``start_offload`` / ``offload`` / ``onload`` for a backend with ``self.model``, ``self.optimizer`` and
    ``self.device``."""

    _offloaded: list[tuple[dict, str]] | None = None
    """The optimizer state entries on the host (None while the trainer is on the GPU)."""
    _offloaded_bytes = 0
    _leaving: tuple[torch.cuda.Event, list[tuple[dict, str, torch.Tensor]]] | None = None
    """Copies to the host in flight: their end, and each (state, key, host copy); the state still holds the GPU
    tensor (valid: nothing writes it before the next optimizer step)."""
    _arriving: tuple[torch.cuda.Event, list[torch.Tensor]] | None = None
    """Copies to the GPU in flight: their end, and the host copies they read."""
    _stream: torch.cuda.Stream | None = None

    def start_offload(self) -> None:
        """Colocated GPUs, after training: the optimizer state's copies to the host start (``offload`` ends them)."""
        if self.device.type != "cuda" or self._offloaded is not None or self._leaving is not None:
            return
        self._optimizer_state_ready()
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the optimizer step that wrote the state
        with torch.cuda.stream(stream):
            copies = [(state, key, state[key].to("cpu", non_blocking=True))
                      for state, key in _gpu_state(self.optimizer)]
        self._leaving = (stream.record_event(), copies)

    def offload(self) -> float:
        """Colocated GPUs: parameters and optimizer state to the host while engines generate. Returns the GPU
        bytes this process still holds (0 on CPU, where nothing moves)."""
        if self.device.type != "cuda":
            return 0.0
        if self._offloaded is None:
            held = torch.cuda.memory_allocated()
            self.start_offload()
            self.model.to("cpu", non_blocking=True)
            event, copies = self._leaving
            event.synchronize()
            for state, key, host in copies:
                state[key] = host
            torch.cuda.current_stream().synchronize()  # the parameters' copies
            self._leaving = None
            self._offloaded = [(state, key) for state, key, _ in copies]
            torch.cuda.empty_cache()
            self._offloaded_bytes = held - torch.cuda.memory_allocated()
        return float(torch.cuda.memory_allocated())

    def onload_fits(self, also: float = 0.0) -> bool:
        """Whether ``onload`` fits the device's free memory now, with ``ONLOAD_MARGIN`` to spare (then it may run while
        colocated engines still release theirs: a release only adds free memory). ``also``: bytes another backend of
        this process brings back at the same time (on-policy distillation's teacher, train/group.py)."""
        if self.device.type != "cuda" or self._offloaded is None:
            return True
        return torch.cuda.mem_get_info(self.device)[0] >= self._offloaded_bytes + also + ONLOAD_MARGIN

    @property
    def offloaded_bytes(self) -> float:
        """The GPU bytes ``offload`` moved to the host and ``onload`` will bring back (0 while on the GPU)."""
        return float(self._offloaded_bytes) if self._offloaded is not None else 0.0

    def peak_memory(self) -> float:
        """The most GPU memory torch allocated in this process since the last call (bytes; 0 on CPU)."""
        if self.device.type != "cuda":
            return 0.0
        peak = float(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return peak

    def onload(self) -> float:
        """Back on the GPU before training: the parameters now, the optimizer state on the side stream (waited for
        by ``_optimizer_state_ready``); returns the GPU bytes held."""
        if self.device.type != "cuda":
            return 0.0
        if self._offloaded is not None:
            self.model.to(self.device, non_blocking=True)
            main, stream = torch.cuda.current_stream(), self._side_stream()
            hosts = [state[key] for state, key in self._offloaded]
            for (state, key), host in zip(self._offloaded, hosts):  # allocated on the current stream, which uses them
                state[key] = torch.empty_like(host, device=self.device)
                state[key].record_stream(stream)  # not reused before the copy into it ends, whatever frees it
            stream.wait_stream(main)  # the memory may have been freed by work still queued there
            with torch.cuda.stream(stream):
                for (state, key), host in zip(self._offloaded, hosts):
                    state[key].copy_(host, non_blocking=True)
            self._arriving = (stream.record_event(), hosts)
            self._offloaded = None
            main.synchronize()  # the parameters' copies
        return float(torch.cuda.memory_allocated())

    def _optimizer_state_ready(self, to_write: bool = False) -> None:
        """Before the optimizer state is read: the current stream waits for its copies back to the GPU. ``to_write``
        (an optimizer step): copies to the host still in flight are dropped too (they would be stale; the state
        stays on the GPU)."""
        if self._arriving is not None:
            event, _ = self._arriving
            torch.cuda.current_stream().wait_event(event)
            event.synchronize()  # then the host copies may go back to the pinned cache
            self._arriving = None
        if to_write and self._leaving is not None:
            self._leaving[0].synchronize()
            self._leaving = None

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream
