"""Sibling projections as one matmul: the query, key and value projections of an attention block, and the gate and
up projections of a gated MLP, read the same input; the engine multiplies it by their stacked weights once.

Why: a decode step of a small model at batch 256 is a few hundred small GEMMs, each far from the GPU's peak. On an
H200 at Qwen2.5-0.5B's shapes, one GEMM over the stacked q/k/v weights took 4.5 us where the three took 12.0, and
gate+up 10.5 us where the two took 13.9: ~0.26 ms of a 2.6 ms step (docs/benchmarks.md). transformers' modules run
them apart and torch.compile does not merge them, so this is done here; SGLang and vLLM load such models with stacked
weights for the same reason.

How:
- The siblings' weights (and biases) move into one tensor, a non-persistent buffer of their parent module
  (``stacked_weight``, ``stacked_bias``), and each sibling's parameter becomes a view of its rows. The model's state
  dict, the names weight updates use and their in-place copies are unchanged.
- Each sibling becomes a ``Columns`` module that keeps its parameters and returns its columns of the stacked product;
  the parent's forward computes that product and hands it to the parent class's own forward in place of the input.
  The block's code stays transformers' own: only classes whose forward uses its input for the siblings and its shape
  alone are stacked (``SIBLINGS``), and only plain ``nn.Linear`` siblings (not LoRA-wrapped ones).
- The engine then places all weights in one allocation (memory.place), which keeps the views views.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn

_ATTENTION = ("hidden_states", ("q_proj", "k_proj", "v_proj"))
_MLP = ("x", ("gate_proj", "up_proj"))
SIBLINGS = {
    "LlamaAttention": _ATTENTION, "MistralAttention": _ATTENTION, "Qwen2Attention": _ATTENTION,
    "Qwen3Attention": _ATTENTION, "Qwen3MoeAttention": _ATTENTION, "Glm4Attention": _ATTENTION,
    "LlamaMLP": _MLP, "MistralMLP": _MLP, "Qwen2MLP": _MLP, "Qwen3MLP": _MLP, "Qwen3MoeMLP": _MLP,
}
"""transformers class name -> (the name of its forward's input, the sibling projections that read it)."""


class Columns(nn.Module):
    """A stacked sibling: holds its weight and bias (views of the parent's stacked tensors) and returns columns
    ``start:stop`` of the stacked product it is handed."""

    def __init__(self, linear: nn.Linear, start: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.start, self.stop = start, start + linear.out_features

    def forward(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked[..., self.start:self.stop]


def stack(model: nn.Module) -> list[nn.Module]:
    """Stack the siblings of every module of ``model`` that has them (``SIBLINGS``); returns those modules."""
    parents = []
    for module in model.modules():
        entry = SIBLINGS.get(type(module).__name__)
        if entry is None:
            continue
        linears = [getattr(module, name, None) for name in entry[1]]
        if not all(type(linear) is nn.Linear for linear in linears) or len({l.bias is None for l in linears}) > 1:
            continue
        start = 0
        for name, linear in zip(entry[1], linears):
            setattr(module, name, Columns(linear, start))
            start += linear.out_features
        module.register_buffer("stacked_weight", None, persistent=False)
        module.register_buffer("stacked_bias", None, persistent=False)
        _restack(module)
        module.forward = types.MethodType(_stacked_forward, module)
        parents.append(module)
    return parents


def _stacked_forward(self, *args, **kwargs):
    """The parent class's forward, given the stacked product in place of its input (a method of every parent, so
    that torch.compile traces one code for all layers)."""
    name = SIBLINGS[type(self).__name__][0]
    if name in kwargs:
        kwargs[name] = F.linear(kwargs[name], self.stacked_weight, self.stacked_bias)
    else:
        args = (F.linear(args[0], self.stacked_weight, self.stacked_bias),) + args[1:]
    return type(self).forward(self, *args, **kwargs)


def _columns(module: nn.Module) -> list[Columns]:
    return [getattr(module, name) for name in SIBLINGS[type(module).__name__][1]]


def _restack(module: nn.Module) -> None:
    """Build the parent's stacked tensors from its siblings' parameters, which become views of them."""
    with torch.no_grad():
        columns = _columns(module)
        for kind in ("weight", "bias"):
            if getattr(columns[0], kind) is None:
                continue
            whole = torch.cat([getattr(c, kind).data for c in columns])
            for c in columns:
                getattr(c, kind).data = whole[c.start:c.stop]
            setattr(module, f"stacked_{kind}", whole)
