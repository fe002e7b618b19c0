"""DeepSeek-V3's multi-latent attention (MLA) on megatron-core's ``MLASelfAttention``, on CPU and GPU.

The layer is megatron's (``megatron/core/transformer/multi_latent_attention.py``): its projections
(``linear_q_down_proj`` -> ``q_layernorm`` -> ``linear_q_up_proj``, or ``linear_q_proj`` without query compression;
``linear_kv_down_proj`` -> ``kv_layernorm`` -> ``linear_kv_up_proj``; ``linear_proj``), its softmax scale
(1 / sqrt(qk_head_dim + qk_pos_emb_head_dim) times yarn's mscale(rotary_scaling_factor, mscale_all_dim) squared) and
its forward. Per head, with the latents c_q = RMSNorm(W_dq x) and c_kv = RMSNorm(W_dkv x):

    q = W_uq c_q = [q_nope (qk_head_dim), q_rope (qk_pos_emb_head_dim)]
    [k_nope, v] = W_ukv c_kv                              k_rope: the last qk_pos_emb_head_dim channels of W_dkv x,
    key = [k_nope, RoPE(k_rope)], query = [q_nope, RoPE(q_rope)]        one for all heads
    out = softmax(query key^T * scale) v   (v_head_dim wide)

This backend's parts:

- ``LatentAttention.get_query_key_value_tensors`` (the training path; megatron's forward calls it). megatron's
  rotary module is built on ``torch.cuda.current_device()`` and its yarn module moves its tables to CUDA on first
  use; here the rotary is ``LatentRotary`` (transformers' own inverse frequencies and yarn attention factor, so any
  rope_type transformers implements is reproduced exactly), built before the layer and handed to megatron's
  constructor in place of its ``RotaryEmbedding`` (``_constructible``, which also keeps megatron's TransformerEngine
  check from raising where TE is not installed). The arithmetic is megatron's: its
  ``apply_rotary_pos_emb`` (which, for MLA, first de-interleaves the rotary channels: transformers'
  ``rope_interleave=True``) with the attention factor as its ``mscale``. One gradient differs: megatron gathers the
  TP-split ``linear_kv_down_proj`` output and gives k_rope, shared by all heads, to this rank's heads only; the
  gather's backward then keeps this rank's slice, so the k_rope rows' gradient would hold only one rank's heads.
  Here k_rope passes an identity whose backward sums its gradient over TP first (moe's ``_IntoTP``), and the
  gather is ``_GatherChannels`` (megatron's allocates on ``torch.cuda.current_device()``).
- ``LatentNorm``: transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps (1e-6), not
  rms_norm_eps; megatron passes layernorm_epsilon.
- ``rope_interleave=False`` checkpoints: the rotary rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa are
  interleaved on loading (convert.py) so that megatron's de-interleaving restores transformers' layout.

The core attention is spec.SDPACoreAttention (keys qk_head_dim + qk_pos_emb_head_dim wide, values v_head_dim).
"""

import importlib.util
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from slime_hydra.train.megatron.moe import _IntoTP
from slime_hydra.train.megatron.spec import HFRotaryEmbedding, RowParallelLinear, SDPACoreAttention, mlp_spec

LATENT_NORM_EPS = 1e-6
"""transformers' eps of DeepSeek-V3's q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm's default)."""


class LatentNorm:
    """torch's RMSNorm over a latent with transformers' eps, built where megatron builds q/kv_layernorm (which passes
    its layernorm_epsilon)."""

    def __new__(cls, config, hidden_size: int, eps: float = LATENT_NORM_EPS):
        return torch.nn.RMSNorm(hidden_size, eps=LATENT_NORM_EPS)


class LatentRotary(HFRotaryEmbedding):
    """RoPE of the qk_pos_emb_head_dim rotary channels from transformers' inverse frequencies, with its attention
    factor (yarn's mscale / mscale_all_dim ratio; 1 otherwise). Called as megatron's yarn module is:
    ``(max_seq_len) -> (emb [s, 1, 1, d], mscale)`` (this CP rank's positions with cp > 1)."""

    def __init__(self, inv_freq: torch.Tensor, mscale: float, cp_group=None):
        super().__init__(inv_freq, rotary_interleaved=False, cp_group=cp_group)
        self.mscale = mscale

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.mscale


@contextmanager
def _constructible(rotary: LatentRotary):
    """Two module globals of megatron-core 0.16.1's multi_latent_attention, set while a layer is constructed:
    MultiLatentAttention builds ``RotaryEmbedding(...)`` without use_cpu_initialization, i.e. on
    ``torch.cuda.current_device()`` (here the name gives ``rotary``); and without TransformerEngine its
    ``HAVE_TE`` is still true (its TE classes are stand-ins, which make its ``isinstance(linear_proj, TELinear)``
    check raise), so it is false unless TransformerEngine imports."""
    saved = multi_latent_attention.RotaryEmbedding, multi_latent_attention.HAVE_TE
    multi_latent_attention.RotaryEmbedding = lambda *args, **kwargs: rotary
    multi_latent_attention.HAVE_TE = saved[1] and importlib.util.find_spec("transformer_engine") is not None
    try:
        yield
    finally:
        multi_latent_attention.RotaryEmbedding, multi_latent_attention.HAVE_TE = saved


def latent_layer_spec(arch, config, use_te: bool, moe: bool, rotary: LatentRotary) -> ModuleSpec:
    """One decoder layer of multi-latent attention: megatron's local MLA layer spec with LatentAttention (applying
    ``rotary``), LatentNorm latent norms, spec.SDPACoreAttention and spec.RowParallelLinear, and spec.mlp_spec's MLP.
    Always the local spec (TransformerEngine's MLA spec is not mapped by convert.py)."""
    experts = dict(num_experts=arch.num_experts) if moe else {}
    spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm",
                                    **experts)
    attention = spec.submodules.self_attention
    attention.module = LatentAttention
    attention.params = {**attention.params, "rotary": rotary}
    attention.submodules.core_attention = SDPACoreAttention
    attention.submodules.linear_proj = RowParallelLinear
    attention.submodules.q_layernorm = attention.submodules.kv_layernorm = LatentNorm
    return mlp_spec(spec, arch, config, False, moe)


class LatentAttention(MLASelfAttention):
    """megatron's MLA self-attention with ``rotary`` (a LatentRotary) and the training path's query/key/value
    (module docstring). Inference contexts, packed sequences, fused RoPE, cached latents and recomputed up
    projections are megatron's other paths, not used by this backend: refused."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal, cp_comm_type=None,
                 pg_collection=None, rotary: LatentRotary | None = None):
        if config.rope_type != "rope":
            raise ValueError(f"LatentAttention applies transformers' RoPE itself; rope_type={config.rope_type!r} "
                             "would build megatron's yarn module (the softmax mscale comes from "
                             "rotary_scaling_factor and mscale_all_dim alone)")
        with _constructible(rotary):
            super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        """query [s, b, heads, qk_head_dim + qk_pos_emb_head_dim], key likewise, value [s, b, heads, v_head_dim]
        of this TP rank's heads, and the two latents (megatron's return signature)."""
        c = self.config
        if (packed_seq_params is not None or inference_context is not None or inference_params is not None
                or key_value_states is not None or c.apply_rope_fusion or c.cache_mla_latents
                or self.recompute_up_proj):
            raise NotImplementedError("train=megatron's MLA runs padded [s, b] training batches only")
        emb, mscale = self.rotary_pos_emb(self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, c, None))
        emb = emb[:hidden_states.shape[0]]
        heads = self.num_attention_heads_per_partition
        if c.q_lora_rank is None:
            q_latent = hidden_states
            q, _ = self.linear_q_proj(hidden_states)
        else:
            q_latent = self.q_layernorm(self._gathered(self.linear_q_down_proj(hidden_states)[0]))
            q, _ = self.linear_q_up_proj(q_latent)
        kv_latent, k_rope = self._gathered(self.linear_kv_down_proj(hidden_states)[0]).split(
            [c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        if self.tp_group is not None and self.tp_group.size() > 1:  # every TP rank's heads use k_rope
            k_rope = _IntoTP.apply(k_rope, self.tp_group)
        kv_latent = self.kv_layernorm(kv_latent)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        q_nope, q_rope = q.view(*q.shape[:2], heads, self.q_head_dim).split(
            [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        k_nope, value = kv.view(*kv.shape[:2], heads, c.qk_head_dim + c.v_head_dim).split(
            [c.qk_head_dim, c.v_head_dim], dim=-1)
        cp = self.pg_collection.cp
        q_rope = apply_rotary_pos_emb(q_rope, emb, config=c, mscale=mscale, cp_group=cp)
        k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(-2), emb, config=c, mscale=mscale, cp_group=cp)
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous(), q_latent, kv_latent

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """A column-parallel down projection's output, all of its channels on every TP rank."""
        if self.tp_group is None or self.tp_group.size() == 1:
            return local
        return _GatherChannels.apply(local, self.tp_group)


class _GatherChannels(torch.autograd.Function):
    """All-gather along the last dim over ``group`` (rank order); backward: this rank's slice of the gradient, which
    is whole on every rank. megatron's gather_from_tensor_model_parallel_region, whose buffer is allocated with
    ``torch.cuda.current_device()``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)].contiguous(), None
