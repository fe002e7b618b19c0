"""The batch-invariant forward of ``algo.true_on_policy``: every position's outputs computed by the same operations,
in the same shapes and order, whatever else shares the call. The embedded engine (a decode step: one new token per
running request, batched with whatever requests run; a prefill: the prompts admitted together) and the trainer (every
position of a padded or packed micro-batch) then compute the same bits for every response token, and the trainer's
logprobs equal the engine's exactly.

The rule throughout: a kernel library picks its algorithm, and with it the order of a reduction, from the shapes of
a call (MKL its blocking, cuBLAS and SDPA their kernels, split-K or not, by the row count), so every call this module
makes has one shape, whatever the batch. Measured with ``scripts/probe_batch_invariance.py`` (CPU fp32, torch 2.13;
an H200 in bf16, torch 2.11) and end to end by ``tests/train/test_true_on_policy.py`` (CPU) and
``tests/train/test_true_on_policy_gpu.py``:

- **Matmuls.** Row r of ``F.linear`` over 1..5 rows differs from the same row in a call of 300 (CPU).
  ``tiled_linear`` runs every linear as matmuls of exactly ``ROWS[device]`` rows (the last padded with zero rows):
  one GEMM shape, and a row's result does not depend on the other rows of its call (0 of 1,000 rows differed). On
  CPU matmuls of 128 rows cost ~1.4x a plain ``F.linear`` of 6,400 rows (13.6 ms against 9.5, 128 -> 384).
- **Attention.** The engine's decode attends one query per request (its query heads folded into SDPA's query axis,
  ``q [rows, kv_heads, group, d]``) over the columns ``0..window-1`` of its cache under the mask
  ``column <= position``. ``rows_attention`` computes the prefill's and the trainer's attention in that same form,
  one row per position, its sequence's keys copied to every row; ``sdpa_rows`` runs such rows ``ATTENTION_ROWS`` at
  a time, the decode's too. SDPA computes each row of its batch alone, and the masked columns add exact zeros, so
  the window's width does not change the bits (measured: windows of 128 to 2,048 columns). The trainer's backward
  is the plain causal attention's (``DecodeFormAttention``).
- **RMSNorm's mean** over the hidden size: on CPU a row's sum does not depend on the row count, on an H200 it does
  (16 of 1,000 rows of small calls differed, by 1.2e-7: torch's CUDA reductions split a row over more threads when
  there are few rows). ``tree_sum`` adds the squares by halving the row with elementwise adds, an order fixed by the
  width alone; ``make_batch_invariant`` runs the standard RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, every
  dense family's) with it.
- **Log-softmax** over the vocabulary and **elementwise operations** are computed per row and per element, whatever
  the row count (measured on CPU and on an H200: ``scripts/probe_batch_invariance.py``).
- **Logprobs** are ``scaled_log_softmax``, the engine's formula (``log_softmax(logits / T)`` at the token), in both;
  the trainer's default ``z_y - logsumexp(z)`` rounds differently.
- The engine's stacked q/k/v and gate/up projections (``stacking.py``) are one wider matmul, another GEMM shape: off
  under this mode; so are torch.compile (fusion changes the rounding) and LoRA (PEFT's adapter branch is a second
  matmul the engine's merged weights do not make). config/rules.py refuses those combinations.

Written here: no library makes a transformers model batch-invariant on CPU (the batch-invariant kernels published
for this, thinking-machines-lab/batch_invariant_ops, are Triton kernels for CUDA).
"""

import types
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

ROWS = {"cpu": 128, "cuda": 256}
"""Rows per matmul of ``tiled_linear``, by device type (a GPU's decode step is bound by reading the weights: 256 rows
cost it about what one does)."""
ATTENTION_ROWS = 64
"""Rows (positions) per SDPA call of ``sdpa_rows``."""
MIN_WINDOW = 128
"""The narrowest attention window of ``rows_attention`` (the engine's slot cache starts this wide)."""
ATTENTION = "slime_invariant"
"""The attn_implementation name of ``trainer_attention`` in transformers' AttentionInterface."""


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` (x [..., K], weight [N, K] -> [..., N]) as matmuls of exactly R x K by K x N (R = ROWS of the
    device; the rows padded with zeros to a multiple of R), so a row's result is the same in any call; the bias is
    added afterwards."""
    rows = x.reshape(-1, x.shape[-1])
    count, tile = rows.shape[0], ROWS.get(x.device.type, ROWS["cpu"])
    rows = F.pad(rows, (0, 0, 0, -count % tile))
    w = weight.t()
    out = torch.cat([part @ w for part in rows.split(tile)])[:count]  # split: one gradient copy back, not one a tile
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _tiled_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return tiled_linear(x, self.weight, self.bias)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis ([..., n] -> [..., 1]) by pairwise elementwise adds: the row padded with zeros to a
    power of two, then its halves added until one column is left. Every element's order of additions depends on n
    only, never on how many rows the call has."""
    width = x.shape[-1]
    x = F.pad(x, (0, (1 << (width - 1).bit_length()) - width))
    while x.shape[-1] > 1:
        low, high = x.chunk(2, dim=-1)
        x = low + high
    return x


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen2, Qwen3, Llama, GLM-4: the same formula) with ``tree_sum``'s mean:
    ``weight * (x / sqrt(mean(x^2) + eps))``, the normalisation in fp32 and cast back to x's dtype before the
    weight."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = tree_sum(hidden.pow(2)) / hidden.shape[-1]
    return weight * (hidden * torch.rsqrt(variance + eps)).to(dtype)


def _rms_norm_forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden, self.weight, self.variance_epsilon)


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Run every ``nn.Linear`` of ``model`` (the LM head included) through ``tiled_linear`` and every RMSNorm
    through ``tree_sum``; returns how many modules changed. Another kind of norm is refused (ValueError)."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_tiled_forward, module)
        elif type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
        elif "Norm" in type(module).__name__:
            raise ValueError(f"algo.true_on_policy: {type(module).__name__} has no batch-invariant form here")
        else:
            continue
        changed += 1
    return changed


def window_for(length: int) -> int:
    """The attention window (columns) of a sequence of ``length`` tokens: the next power of two, at least
    MIN_WINDOW (the engine's decode window follows the same rule, capped by its cache's capacity)."""
    return max(MIN_WINDOW, 1 << (length - 1).bit_length())


def sdpa_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: Optional[float]) -> torch.Tensor:
    """SDPA of independent rows (query [n, kv_heads, group, d], keys/values [n, kv_heads, window, d(v)], mask
    [n, 1, 1, window]) in calls of exactly ATTENTION_ROWS rows, the last one filled up with copies of row 0 (their
    outputs dropped): one shape per window, whatever n."""
    count, out, whole = query.shape[0], [], (query, keys, values, mask)
    for start in range(0, count, ATTENTION_ROWS):
        part = [t[start:start + ATTENTION_ROWS] for t in whole]
        short = ATTENTION_ROWS - part[0].shape[0]
        if short:
            part = [torch.cat([p, t[:1].expand(short, *t.shape[1:])]) for p, t in zip(part, whole)]
        out.append(F.scaled_dot_product_attention(*part[:3], attn_mask=part[3], scale=scale))
    return torch.cat(out)[:count]


def rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: Optional[float]) -> torch.Tensor:
    """Causal attention of each row of a right-padded batch in the engine's decode form: query [b, heads, L, d],
    key/value [b, kv_heads, L, d(v)] (positions 0..L-1 of each row) -> [b, L, heads, dv]. Position p of a row is one
    SDPA row: its query heads grouped by key/value head, against its row's keys padded to ``window_for(L)``
    columns (broadcast to every position, not copied), masked to columns <= p (a padding position's output is never
    read)."""
    b, heads, width, dim = query.shape
    kv_heads, window = key.shape[1], window_for(width)
    rows = width + -width % ATTENTION_ROWS  # <= window: positions padded with zero queries, so sdpa_rows copies nothing
    keys, values = (F.pad(t, (0, 0, 0, window - width)) for t in (key, value))  # [b, kv_heads, window, d]
    grouped = F.pad(query.transpose(1, 2), (0, 0, 0, 0, 0, rows - width)).reshape(
        b, rows, kv_heads, heads // kv_heads, dim)
    columns = torch.arange(window, device=query.device)
    mask = (columns[None, :] <= torch.arange(rows, device=query.device)[:, None])[:, None, None, :]
    out = torch.stack([sdpa_rows(grouped[i], keys[i].expand(rows, -1, -1, -1), values[i].expand(rows, -1, -1, -1),
                                 mask, scale) for i in range(b)])
    return out[:, :width].reshape(b, width, heads, value.shape[-1])


def _sequences(attend, query, key, value, scale, bounds: Optional[list[int]]) -> torch.Tensor:
    """``attend`` (query [b, heads, L, d], key, value, scale -> [b, L, heads, dv]) over a right-padded batch
    (bounds None) or over each sequence of a packed row (query [1, heads, N, d], sequence i = bounds[i]:bounds[i+1])."""
    if bounds is None:
        return attend(query, key, value, scale)
    parts = [attend(query[:, :, a:z], key[:, :, a:z], value[:, :, a:z], scale)
             for a, z in zip(bounds[:-1], bounds[1:]) if z > a]
    return torch.cat(parts, dim=1)


def _causal(query, key, value, scale) -> torch.Tensor:
    """Plain causal attention (SDPA's own kernels), [b, heads, L, d] -> [b, L, heads, dv]."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                          enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2)


class DecodeFormAttention(torch.autograd.Function):
    """The trainer's attention: the forward in the engine's decode form (``rows_attention``: the bits the engine
    computed), the backward the gradient of the same causal attention through SDPA's own kernels, recomputed from
    the saved query, key and value. Only the forward's bits must be the engine's; a backward through the decode
    form would keep every position's copy of its keys (the decode form's cost is its forward)."""

    @staticmethod
    def forward(ctx, query, key, value, scale, bounds):
        ctx.save_for_backward(query, key, value)
        ctx.scale, ctx.bounds = scale, bounds
        return _sequences(rows_attention, query, key, value, scale, bounds)

    @staticmethod
    def backward(ctx, grad):
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _sequences(_causal, query, key, value, ctx.scale, ctx.bounds)
        return (*torch.autograd.grad(out, (query, key, value), grad), None, None)


def trainer_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      cu_seq_lens_q: Optional[torch.Tensor] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol for the trainer: a packed row (query [1, heads, N, d] with
    ``cu_seq_lens_q``: attention inside each sequence) or a right-padded batch (query [b, heads, L, d]: each row
    from position 0; a padding position's output is never read) -> ([b, L, heads, dv], None)."""
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"algo.true_on_policy: the batch-invariant attention does not implement {name}")
    if dropout:
        raise ValueError("algo.true_on_policy: the batch-invariant attention has no dropout")
    bounds = None if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    return DecodeFormAttention.apply(query, key, value, scaling, bounds), None


def register_attention() -> str:
    """Make ``attn_implementation=ATTENTION`` (``trainer_attention``) available to transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, trainer_attention)
    return ATTENTION


@contextmanager
def engine_kernels() -> Iterator[None]:
    """The block runs torch's default kernels, the engine's, also where ``deterministic=true`` turned on torch's
    deterministic algorithms (``TrainRank.setup``) for the rest of the trainer's work (the losses, the backward, the
    optimizer step). Measured on an H200 (bf16, the tiny model, 16 sequences of 33 tokens): the same weights gave the
    engine's logprobs bit for bit in a forward with the default kernels, and in 4 of the 16 sequences others (by up
    to 0.0019 nats) in a forward under ``torch.use_deterministic_algorithms(True)``; cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``) changed nothing. The default kernels of this forward repeat run to run (the
    engine's do: tests/loop/test_deterministic_gpu.py)."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def scaled_log_softmax(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32 over the last axis: the engine's logprobs (sampling.py) and, under
    algo.true_on_policy, the trainer's. temperature: a float, or one per row broadcast against ``logits``. A float
    becomes a tensor on the logits' device first: CUDA divides by a host scalar as a multiplication by its
    reciprocal, which rounds otherwise than the division by a tensor the engine makes."""
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    return torch.log_softmax(logits.float() / temperature, dim=-1)
