"""train.pack_sequences on train=megatron (train/packing.py has the layout): each micro-batch runs as one row in
megatron's THD format (``PackedSeqParams`` with the sequences' cu_seqlens, b = 1); spec.SelfAttention rotates each
token by its position in its own sequence and SDPACoreAttention attends within it; the output layer runs on the
positions that predict response tokens only (MegatronBackend's output-layer hook keeps them). Needs cp = pp = 1,
no sequence parallelism and no multi-latent attention (train/config.megatron_packing_problem)."""

import torch

from slime_hydra.train.megatron.vocab_parallel import vocab_parallel_logprobs
from slime_hydra.train.packing import PackedBatch, packed_values


def thd_params(packed: PackedBatch):
    """megatron's PackedSeqParams of a packed row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                           max_seqlen_q=packed.max_length, max_seqlen_kv=packed.max_length)


def packed_head(out: torch.Tensor, packed: PackedBatch, backend, temperature: float, with_entropy: bool):
    """[b, T] logprobs (and entropy) from the [1, K, V / tp] logits of the kept positions, or the critic's values
    from [1, N, 1]; ``backend``: the MegatronBackend (its head kind, TP group, vocabulary slice and compiled
    single-rank head)."""
    if backend.head == "value":
        return packed_values(out, packed), None
    if backend.tp_size == 1:
        return backend._lm_logprobs(out, packed, temperature, with_entropy)
    logits = out.float() / temperature if temperature != 1.0 else out.float()
    logp, entropy = vocab_parallel_logprobs(logits, packed.targets.unsqueeze(0), backend.vocab_start,
                                            backend.tp_group, with_entropy)
    return (logp[0][packed.index] * packed.valid,
            entropy[0][packed.index] * packed.valid if with_entropy else None)
