"""Padding-free micro-batches (``train.pack_sequences``, both backends): a micro-batch's sequences concatenated into one
row, attention kept inside each sequence by variable-length attention, the LM head run only where a response token
is predicted.

Layout of a micro-batch of b samples (sample i: n_i = P_i + R_i tokens, offset o_i = n_0 + ... + n_{i-1}, N = sum n_i):

    input_ids     [1, N]   the samples' tokens, back to back (no padding)
    position_ids  [1, N]   0 .. n_i - 1 within each sample (RoPE restarts per sample)
    cu_seqlens    [b + 1]  int32 sequence boundaries o_0 = 0, o_1, ..., N (flash attention's varlen layout)
    keep          [K]      K = sum R_i positions o_i + P_i - 1 + j whose outputs predict response token j, ascending
    targets       [K]      the token each kept position predicts (input_ids[keep + 1])
    index, valid  [b, T]   column j of row i is kept entry (R_0 + ... + R_{i-1}) + j, valid while j < R_i

With train.cuda_graphs the row's shapes are bucketed (``_bucket``): a filler sequence after the samples, empty
sequences at the end of cu_seqlens, max_length rounded up.

So a packed micro-batch costs sum n_i positions (a padded one b * max n_i) and the LM head, whose vocabulary
projection is the largest matmul of a small model, runs on the K response positions only. Outputs come back in the
padded [b, T] layout (train/batch.py), so losses and BatchLogprobs see no difference.

Attention (``packed_attention``, registered with transformers as ATTENTION): on CUDA in bf16/fp16, torch's
``varlen_attn`` (FlashAttention-2 on cu_seqlens: cost sum n_i^2, nothing across samples); elsewhere (the CPU
tests, fp32, query and value heads of different widths as in multi-latent attention) torch SDPA under a
block-diagonal causal mask, N^2 but exact. Written here: transformers' own packed path (position_ids without an
attention mask) builds that dense N^2 mask for SDPA and reaches varlen kernels only through the flash-attn package,
which these machines do not have.
"""

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention.varlen import varlen_attn

from slime_hydra.train.batch import TrainBatch, position_logprobs, to_device

ATTENTION = "slime_packed"
"""The attn_implementation name of ``packed_attention`` in transformers' AttentionInterface."""


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    keep: torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    routed_experts: Optional[torch.Tensor] = None

    def to(self, device: torch.device | str) -> "PackedBatch":
        moved = {k: (to_device(v, device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return PackedBatch(**moved)

    def model_kwargs(self) -> dict:
        """What the transformers forward takes (the cu_seqlens reach every attention call as keyword arguments)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_length, "max_length_k": self.max_length}


def pack(mb: TrainBatch, bucketed: bool = False) -> PackedBatch:
    """The packed layout (module docstring) of a host micro-batch; ``bucketed`` (train.cuda_graphs): its shapes
    rounded so that a run meets few of them (``_bucket``)."""
    lengths = mb.attention_mask.sum(-1).tolist()
    starts, responses = mb.response_start.tolist(), mb.response_lengths.tolist()
    if min(starts) < 1:
        raise ValueError("packing needs at least one prompt token per sample (the first response token is predicted "
                         "by the position before it)")
    ids = torch.cat([mb.input_ids[i, :n] for i, n in enumerate(lengths)])
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    keep = torch.cat([torch.arange(o + p - 1, o + p - 1 + r) for o, p, r in zip(offsets, starts, responses)])
    targets = ids[keep + 1]
    first_kept = torch.tensor([0] + responses[:-1]).cumsum(0)
    cols = torch.arange(mb.loss_mask.shape[1])
    valid = cols.unsqueeze(0) < torch.tensor(responses).unsqueeze(1)
    index = torch.where(valid, first_kept.unsqueeze(1) + cols, 0)
    routed = None
    if mb.routed_experts is not None:
        routed = torch.cat([mb.routed_experts[i, :n] for i, n in enumerate(lengths)])
    max_length = max(lengths)
    if bucketed:
        lengths, offsets, max_length = _bucket(lengths, offsets)
        filler = offsets[-1] - ids.shape[0]
        ids = torch.cat([ids, ids.new_zeros(filler)])
        if routed is not None:  # the filler is routed as the last real token (its outputs are never read)
            routed = torch.cat([routed, routed[-1:].expand(filler, *routed.shape[1:])])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(ids.unsqueeze(0), positions.unsqueeze(0), torch.tensor(offsets, dtype=torch.int32), max_length,
                       keep, targets, index, valid, None if routed is None else routed.unsqueeze(0))


BUCKET_TOKENS = 256
"""With train.cuda_graphs a packed row's length is rounded up to a multiple of this many tokens (``_bucket``)."""


def _bucket(lengths: list[int], offsets: list[int]) -> tuple[list[int], list[int], int]:
    """(lengths, offsets, max_length) of a packed row with bucketed shapes, for CUDA graphs: a graph replays one
    shape only, and every micro-batch of an RL run has new lengths, so each would record a new graph (several times
    slower than running eagerly; docs/benchmarks.md). Here the row grows to a multiple of BUCKET_TOKENS tokens by a
    filler sequence of its own (its outputs are never kept), the sequence count to a power of two by empty
    sequences (repeated last offsets in cu_seqlens), and max_length to a power of two (an upper bound is all
    variable-length attention needs). A budget of B tokens then meets at most B / BUCKET_TOKENS row lengths, a few
    sequence counts and a few max_lengths; the filler costs under BUCKET_TOKENS tokens a micro-batch (and its tokens
    reach a MoE router's load-balancing loss, train.megatron.moe_aux_loss_coeff > 0). Written here: no library
    rounds packed batches for CUDA graphs."""
    filler = -offsets[-1] % BUCKET_TOKENS
    if filler:
        lengths, offsets = lengths + [filler], offsets + [offsets[-1] + filler]
    count = 1 << (len(lengths) - 1).bit_length()
    offsets = offsets + [offsets[-1]] * (count - len(lengths))
    return lengths, offsets, 1 << (max(lengths) - 1).bit_length()


def packed_logprobs(logits: torch.Tensor, packed: PackedBatch, temperature: float = 1.0,
                    with_entropy: bool = False, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] logprobs (and entropy) from the logits [1, K, V] of the kept positions; 0 where not valid.

    logp = z[k, y_k] - logsumexp_v z[k, v], z = logits / temperature, y_k = targets[k]; entropy as
    batch.response_logprobs; invariant: the engine's formula (batch.position_logprobs)."""
    per_position, per_position_entropy = position_logprobs(logits[0], packed.targets, temperature, with_entropy,
                                                           invariant)
    logp = per_position[packed.index] * packed.valid
    return logp, (per_position_entropy[packed.index] * packed.valid if with_entropy else None)


def packed_values(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[b, T] critic values V(s_j) from the per-position values [1, N, 1]; 0 where not valid."""
    return values[0, :, 0].float()[packed.keep][packed.index] * packed.valid


VARLEN_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters
"""Whether torch's varlen_attn takes fewer key/value heads than query heads (torch 2.11's does not)."""


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                     sliding_window: Optional[int] = None, cu_seq_lens_q: Optional[torch.Tensor] = None,
                     max_length_q: Optional[int] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: query [1, Hq, N, d], key/value [1, Hkv, N, d(v)] of a packed row
    -> ([1, N, Hq, dv], None); causal within each sequence of ``cu_seq_lens_q``."""
    if cu_seq_lens_q is None:
        raise ValueError("packed attention needs cu_seq_lens_q (train.pack_sequences runs packed micro-batches only)")
    if sliding_window is not None:
        raise ValueError("train.pack_sequences does not support sliding-window attention layers")
    if dropout:
        raise ValueError("packed attention has no dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, d]
    return varlen_causal(q, k, v, cu_seq_lens_q, max_length_q, scaling).unsqueeze(0), None


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int,
                  scale: Optional[float]) -> torch.Tensor:
    """Causal attention inside each sequence of a packed row: q [N, Hq, d], k [N, Hkv, d], v [N, Hkv, dv] ->
    [N, Hq, dv] (Hkv divides Hq: grouped-query attention). Both backends' packed attention (module docstring)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == v.shape[-1]:
        gqa = {}
        if k.shape[1] != q.shape[1]:
            if VARLEN_GQA:
                gqa = {"enable_gqa": True}
            else:  # torch 2.11's varlen_attn takes as many key/value heads as query heads
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scale,
                           window_size=(-1, 0), **gqa)
    position = torch.arange(q.shape[0], device=q.device)
    sample = _sequence_of(cu_seqlens.to(q.device), position)
    mask = (sample.unsqueeze(1) == sample.unsqueeze(0)) & (position.unsqueeze(1) >= position.unsqueeze(0))
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                                           attn_mask=mask, scale=scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])  # [1, H, N, d]
    return out[0].transpose(0, 1)


def sequence_positions(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """[n] position of each token of a packed row within its own sequence (0 at every sequence's start)."""
    position = torch.arange(n, device=cu_seqlens.device)
    return position - cu_seqlens[_sequence_of(cu_seqlens, position)]


def _sequence_of(cu_seqlens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The sequence (0-based) each position of a packed row belongs to."""
    return torch.searchsorted(cu_seqlens[1:], position, right=True)


def register_attention() -> str:
    """Make ``attn_implementation=ATTENTION`` available to transformers models (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    return ATTENTION
