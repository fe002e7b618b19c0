"""The batch-invariant forward of ``algo.true_on_policy``: every position's outputs computed by the same operations,
in the same shapes and order, whatever else shares the call. The embedded engine (a decode step: one new token per
running request, batched with whatever requests run; a prefill: the prompts admitted together) and the trainer (every
position of a padded or packed micro-batch) then compute the same bits for every response token, and the trainer's
logprobs equal the engine's exactly.

What changes a token's bits with batching, and what this module does about it (measured on CPU fp32, torch 2.13,
one or two threads: ``tests/train/test_true_on_policy.py``):

- **Matmuls.** A GEMM's blocking over the reduction depends on its row count: row r of ``F.linear`` over 1..5 rows
  differs from the same row in a call of 300. ``tiled_linear`` runs every linear as a batch of ``TILE``-row matmuls
  (``torch.bmm`` over the rows cut into tiles, the last one padded with zero rows): every call is the same GEMM shape,
  and a row's result does not depend on the other rows of its tile (0 of 129 rows differed, tiles of 1 to 32 rows;
  a tile of 32 costs ~1.3x a plain ``F.linear`` of 6,400 rows on CPU).
- **Attention.** The engine's decode attends one query per request (its query heads folded into SDPA's query axis,
  ``q [rows, kv_heads, group, d]``) over the columns ``0..window-1`` of its cache under the mask
  ``column <= position``. ``per_position_attention`` computes the prefill's and the trainer's attention in that same
  form, one row per position, its sequence's keys broadcast (stride 0, no copy) to every row. SDPA computes each row
  of its batch alone, and the masked columns add exact zeros, so the window's width does not change the bits
  (measured: windows of 128 to 2,048 columns).
- **Row reductions** (RMSNorm's mean, log-softmax over the vocabulary) and elementwise operations are computed per
  row and per element, whatever the row count (measured).
- **Logprobs** are ``scaled_log_softmax``, the engine's formula (``log_softmax(logits / T)`` at the token), in both;
  the trainer's default ``z_y - logsumexp(z)`` rounds differently.
- The engine's stacked q/k/v and gate/up projections (``stacking.py``) are one wider matmul, another GEMM shape: off
  under this mode; so are torch.compile (fusion changes the rounding) and LoRA (PEFT's adapter branch is a second
  matmul the engine's merged weights do not make). config/rules.py refuses those combinations.

Written here: no library makes a transformers model batch-invariant on CPU (the batch-invariant kernels published
for this, thinking-machines-lab/batch_invariant_ops, are Triton kernels for CUDA).
"""

import types
from typing import Optional

import torch
import torch.nn.functional as F

TILE = 32
"""Rows per matmul of ``tiled_linear``."""
MIN_WINDOW = 128
"""The narrowest attention window of ``per_position_attention`` (the engine's slot cache starts this wide)."""
ATTENTION = "slime_invariant"
"""The attn_implementation name of ``trainer_attention`` in transformers' AttentionInterface."""


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` (x [..., K], weight [N, K] -> [..., N]) as ceil(rows / TILE) matmuls of TILE x K by K x N, so a
    row's result is the same in any call; the bias is added afterwards."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    rows = F.pad(rows, (0, 0, 0, -count % TILE))
    tiles = rows.shape[0] // TILE
    out = torch.bmm(rows.view(tiles, TILE, -1), weight.t().unsqueeze(0).expand(tiles, -1, -1))
    out = out.reshape(-1, weight.shape[0])[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _tiled_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return tiled_linear(x, self.weight, self.bias)


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Run every ``nn.Linear`` of ``model`` (the LM head included) through ``tiled_linear``; returns how many."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for module in linears:
        module.forward = types.MethodType(_tiled_forward, module)
    return len(linears)


def window_for(length: int) -> int:
    """The attention window (columns) of a sequence of ``length`` tokens: the next power of two, at least
    MIN_WINDOW (the engine's decode window follows the same rule, capped by its cache's capacity)."""
    return max(MIN_WINDOW, 1 << (length - 1).bit_length())


def per_position_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scale: Optional[float]) -> torch.Tensor:
    """Causal attention of one sequence in the engine's decode form: query [L, heads, d], key [L, kv_heads, d],
    value [L, kv_heads, dv] (positions 0..L-1) -> [L, heads, dv]. Position p is one SDPA row: its query heads grouped
    by key/value head, against the sequence's keys padded to ``window_for(L)`` columns, masked to columns <= p."""
    length, heads, dim = query.shape
    kv_heads = key.shape[1]
    window = window_for(length)
    keys, values = (F.pad(t.transpose(0, 1), (0, 0, 0, window - length))[None].expand(length, -1, -1, -1)
                    for t in (key, value))  # [L, kv_heads, window, d]: stride 0 over the rows
    grouped = query.reshape(length, kv_heads, heads // kv_heads, dim)
    columns = torch.arange(window, device=query.device)
    mask = (columns[None, :] <= torch.arange(length, device=query.device)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(length, heads, value.shape[-1])


def rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float],
                   lengths: Optional[list[int]] = None) -> torch.Tensor:
    """``per_position_attention`` of each row of a right-padded batch: query [b, heads, L, d], key/value
    [b, kv_heads, L, d] -> [b, L, heads, dv]. lengths: each row's real tokens (default L); the padding positions
    come out as zeros (nothing reads them)."""
    b, _, width, _ = query.shape
    out = query.new_zeros(b, width, query.shape[1], value.shape[-1])
    for i in range(b):
        n = width if lengths is None else lengths[i]
        out[i, :n] = per_position_attention(query[i, :, :n].transpose(0, 1), key[i, :, :n].transpose(0, 1),
                                            value[i, :, :n].transpose(0, 1), scale)
    return out


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
    if cu_seq_lens_q is None:
        return rows_attention(query, key, value, scaling), None
    bounds = cu_seq_lens_q.tolist()
    parts = [per_position_attention(*(t[0, :, start:stop].transpose(0, 1) for t in (query, key, value)), scaling)
             for start, stop in zip(bounds[:-1], bounds[1:]) if stop > start]
    return torch.cat(parts).unsqueeze(0), None


def register_attention() -> str:
    """Make ``attn_implementation=ATTENTION`` (``trainer_attention``) available to transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, trainer_attention)
    return ATTENTION


def scaled_log_softmax(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32 over the last axis: the engine's logprobs (sampling.py) and, under
    algo.true_on_policy, the trainer's. temperature: a float, or one per row broadcast against ``logits``."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)
