"""Mixed precision shared by the training backends: fp32 master parameters, a low-precision compute copy.

``ComputeCopy`` replaces per-op casts (FSDP2's per-parameter casts, torch.autocast's per-use weight casts) by one
multi-tensor copy of all masters into low-precision parameters before the forward/backward, and one multi-tensor
add of their gradients into the masters' fp32 ``.grad`` after each backward. Used by train=fsdp on one rank and by
train=megatron (each rank's own shards, any TP/PP/CP).
"""

from contextlib import contextmanager, nullcontext

import torch

from slime_hydra.train.config import TrainConfig
from slime_hydra.train.offload import Offloadable


def compute_dtype(train: TrainConfig, device: torch.device) -> torch.dtype:
    """The forward/backward dtype: bf16 on CUDA with train.dtype=bf16, else fp32 (CPU runs use fp32)."""
    return torch.bfloat16 if (train.dtype == "bf16" and device.type == "cuda") else torch.float32


class ComputeCopy:
    """Mixed precision on one rank without FSDP: the model's parameters stay the fp32 masters (the optimizer,
    checkpoints, weight sync and the reference swap only see those); inside ``swapped_in`` the modules hold
    low-precision copies refreshed from the masters by one multi-tensor copy, and ``accumulate_grads`` adds each
    backward's low-precision gradients into the masters' fp32 ``.grad`` (FSDP's reduce_dtype=fp32 accumulation).
    ``params``: the masters (default: every parameter); any other parameter must already be in ``dtype`` (LoRA's
    frozen base, kept in the compute dtype without a master)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, params: list[torch.nn.Parameter] | None = None):
        self.dtype = dtype
        self.masters = list(model.parameters()) if params is None else list(params)
        index = {id(p): i for i, p in enumerate(self.masters)}
        self.slots = [(module, name, index[id(p)]) for module in model.modules()  # tied weights: two slots
                      for name, p in module._parameters.items() if p is not None and id(p) in index]
        self.copies: list[torch.nn.Parameter] | None = None  # allocated on first use, freed by offload

    @contextmanager
    def swapped_in(self):
        if self.copies is None:
            self.copies = [torch.nn.Parameter(torch.empty_like(p, dtype=self.dtype), requires_grad=p.requires_grad)
                           for p in self.masters]
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.masters)
        self._place(self.copies)
        try:
            yield
        finally:
            self._place(self.masters)

    def _place(self, params: list[torch.nn.Parameter]) -> None:
        for module, name, i in self.slots:
            module._parameters[name] = params[i]

    def accumulate_grads(self) -> None:
        """masters.grad (fp32) += copies.grad of the last backward; the copies' gradients are freed."""
        pairs = [(m, c.grad) for m, c in zip(self.masters, self.copies) if c.grad is not None]
        if all(m.grad is None for m, _ in pairs):  # the step's first micro-batch
            for m, _ in pairs:
                m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m, _ in pairs], [g for _, g in pairs])
        else:
            for m, _ in pairs:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
            torch._foreach_add_([m.grad for m, _ in pairs], [g for _, g in pairs])
        for c in self.copies:
            c.grad = None


class ComputeCopyBackend(Offloadable):
    """What both backends do with an optional ComputeCopy (``self._compute``, None when compute runs on the
    masters): ``_computing()`` around each forward/backward block, and ``offload`` dropping the copies (rebuilt
    from the masters at the next forward)."""

    _compute: ComputeCopy | None = None

    def _computing(self):
        """The block's forward/backward run on the low-precision copies (else directly on the masters)."""
        return self._compute.swapped_in() if self._compute is not None else nullcontext()

    def offload(self) -> float:
        if self._compute is not None:
            self._compute.copies = None
        return super().offload()
