"""The transformer layer spec, and the modules that let megatron-core run without TransformerEngine or apex.

Which spec:
- TransformerEngine importable and a GPU present: megatron's TE layer spec (fused layernorm-linear, TE attention).
  Not exercised here (no machine we test on has TE); convert.py maps TE's fused-norm parameter names.
- otherwise megatron's local spec with ``SelfAttention`` (megatron's, with a QKV split and RoPE that compile to
  cheap kernels; same arithmetic) and ``SDPACoreAttention`` in place of DotProductAttention (whose score buffer
  and default causal mask are allocated on CUDA, and which materialises the [b, np, s, s] scores: on a GPU the
  SDPA spec trained ~1.7x faster, docs/architecture.md "Machine facts"), and ``RowParallelLinear`` (attention output
  and MLP down projections) passing its TP group, so torch.compile takes a whole layer as one graph. With cp > 1
  attention gathers K/V over the CP group (context_parallel.py: megatron's local attention asserts cp=1, its CP
  lives in TransformerEngine's). The dense MLP is ``GatedMLP``: megatron's, with a SwiGLU whose backward compiles to
  one kernel.
- MoE layers (the sparse layers, ``Arch.moe_layers``): the same attention, and megatron's own MoE layer spec
  (``get_gpt_layer_local_spec(num_experts=...)``: SequentialMLP's experts computed by moe.GroupedExperts; with
  TransformerEngine its spec with grouped GEMM experts) with ``moe.MoE`` and ``moe.Router`` in place of MoELayer and
  TopKRouter; megatron's SharedExpertMLP when the architecture has shared experts (GLM-4.5), none otherwise
  (Qwen3-MoE); the other layers keep the dense MLP.
- Multi-latent attention (DeepSeek-V3): megatron's MLA layer spec with this backend's pieces (mla.py), the same
  SDPACoreAttention (values narrower than keys) and row-parallel output projection; always the local spec.
- GLM-4 adds norms on the attention and MLP outputs before each residual add. The layer applies
  ``bda(training, fused)(sublayer_out_with_bias, residual, dropout_p)`` exactly there, so a bias-dropout-add
  module that norms first (``PostNormBiasDropoutAdd``) expresses them in the spec, for the local and TE specs
  alike; parameters: ``decoder.layers.N.{self_attn,mlp}_bda.norm.weight``.
"""

from contextlib import nullcontext

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention as MegatronSelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from slime_hydra.train.megatron.context_parallel import gather_sequence, split_sequence
from slime_hydra.train.megatron.moe import GroupedExperts, MoE, Router
from slime_hydra.train.packing import sequence_positions, varlen_causal


@torch.library.custom_op("slime_hydra::rope_table", mutates_args=())
def rope_table(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(freqs), sin(freqs) in ``dtype``. An opaque op, so torch.compile materialises the [s, 1, 1, r] tables
    once instead of inlining the two trig functions into every element of the rotation kernels."""
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@rope_table.register_fake
def _(freqs, dtype):
    return freqs.new_empty(freqs.shape, dtype=dtype), freqs.new_empty(freqs.shape, dtype=dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on the first r = cos.shape[-1] channels of t [s, b, heads, d] (r < d: partial rotary, the rest passes):
    x * cos + rotate_half(x) * sin, rotate_half pairing x_i with x_{i + r/2} (or x_{2i} with x_{2i+1} when
    interleaved); megatron's _apply_rotary_pos_emb_bshd, op for op, on precomputed tables."""
    r = cos.shape[-1]
    x, rest = t[..., :r], t[..., r:]
    if interleaved:
        half = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        half = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * cos + half * sin, rest), dim=-1)


class SelfAttention(MegatronSelfAttention):
    """megatron's self-attention with the QKV split and RoPE written so torch.compile makes them cheap kernels.

    Same parameters and arithmetic as megatron's (bit for bit, tests/train/test_megatron.py); two changes in form,
    measured at the 0.5B shape on an H100 (docs/benchmarks.md):
    - RoPE from cos/sin tables made once per call (``rope_table``). The stock forward takes cos(freqs) and
      sin(freqs) inside the rotation, which compile fuses into the kernels rotating q and k, forward and backward:
      every one of the s x b x heads x d elements evaluated both trig functions.
    - The fused QKV output is split as a [s, b, groups, heads_per_group + 2, d] view (``get_query_key_value_tensors``)
      rather than megatron's [.., groups, (heads_per_group + 2) * d] split: the compiled kernels then index
      whole heads (d = 64 contiguous channels) and load vectors; with 448-wide runs (7 query heads) they did not.
    The rotation and split kernels, forward + backward, per layer: 131 us with megatron's forward, 47 us with this
    one (tables included; transformers' rotation in train=fsdp: 31 us).
    Packed rows (train.pack_sequences: ``packed_seq_params`` in the THD format, b = 1) rotate each token by its
    position within its own sequence and attend within it (SDPACoreAttention).
    The training path only: inference contexts, other packed formats, output gates, per-layer no-RoPE and
    recomputed core attention go to megatron's forward, as do fewer query groups than TP ranks to its split."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """query [s, b, heads, d], key and value [s, b, groups, d] of this TP rank, from linear_qkv's rows
        interleaved per query group (q_1 .. q_n, k, v for each group; convert.py writes them so)."""
        if output_gate or not split_qkv or key_value_states is not None or (
                self.config.num_query_groups < self.world_size) or self.config.test_mode:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        mixed, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:2], groups, per_group + 2, d)
        query = mixed[:, :, :, :per_group].reshape(*mixed.shape[:2], groups * per_group, d)
        key, value = mixed[:, :, :, per_group], mixed[:, :, :, per_group + 1]
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        packed = packed_seq_params is not None
        if (inference_context is not None or inference_params is not None
                or (packed and packed_seq_params.qkv_format != "thd")
                or not isinstance(rotary_pos_emb, torch.Tensor) or self.config.attention_output_gate
                or self.config.no_rope_freq or self.checkpoint_core_attention):
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                   attention_bias, packed_seq_params, sequence_len_offset,
                                   inference_params=inference_params)
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if packed:  # the table's row of each token's position in its sequence
            rotary_pos_emb = rotary_pos_emb[sequence_positions(packed_seq_params.cu_seqlens_q, query.shape[0])]
        cos, sin = rope_table(rotary_pos_emb, query.dtype)
        query = rotate(query, cos, sin, self.config.rotary_interleaved)
        key = rotate(key, cos, sin, self.config.rotary_interleaved)
        out = self.core_attention(query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                                  attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return self.linear_proj(out)


class SDPACoreAttention(MegatronModule):
    """Causal (or masked) attention on torch's scaled_dot_product_attention; GQA via enable_gqa (no K/V repeat).

    Takes megatron's layout: query [s, b, heads, d], key [s, b, groups, d], value [s, b, groups, d_v] (this TP
    rank's heads; d_v != d for multi-latent attention, whose layer passes k_channels / v_channels and its softmax
    scale), and an optional boolean mask broadcastable to [b, 1, s, s] with True = masked out. Returns
    [s, b, heads * d_v]. A packed row (``packed_seq_params``, THD, b = 1) attends causally within each sequence
    (packing.varlen_causal).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = (pg_collection.cp if pg_collection is not None
                             else parallel_state.get_context_parallel_group())
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"context parallelism needs causal attention, not {attn_mask_type}")
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes batches without attention bias")
        s, b = query.shape[0], query.shape[1]
        if packed_seq_params is not None:
            if self.cp_group is not None or attention_mask is not None or (self.dropout and self.training):
                raise ValueError("packed rows take causal attention without a mask, dropout or context parallelism")
            out = varlen_causal(query[:, 0], key[:, 0], value[:, 0], packed_seq_params.cu_seqlens_q,
                                packed_seq_params.max_seqlen_q, self.scale)
            return out.reshape(s, b, -1)
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask).permute(2, 0, 1, 3).reshape(s, b, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()
            if causal:
                mask = mask & _causal(q.shape[2], k.shape[2], q.device)
            causal = False
        return self._attend(q, k, v, mask, causal).permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend(self, q, k, v, mask, causal):
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale,
                enable_gqa=q.shape[1] != k.shape[1])

    def _context_parallel(self, query, key, value, attention_mask):
        """All-gather-KV context parallelism (context_parallel.py): this rank's queries (its chunks r and
        2cp-1-r of the sequence) against the whole sequence's keys, one SDPA call per chunk over the keys up to it
        (so the balanced split also balances the work). Returns [b, heads, s_local, d]."""
        if attention_mask is not None:
            raise ValueError("context parallelism takes right-padded causal batches without an attention mask")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        kv = gather_sequence(torch.cat((key, value), dim=-1), self.cp_group)  # one collective: [S, b, groups, 2d]
        k, v = (t.permute(1, 2, 0, 3) for t in kv.split([key.shape[-1], value.shape[-1]], dim=-1))  # [b, g, S, d]
        q = query.permute(1, 2, 0, 3)
        c = q.shape[2] // 2
        outs = []
        for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            keys = (chunk + 1) * c  # global positions [chunk * c, (chunk + 1) * c) see keys [0, (chunk + 1) * c)
            mask = None if chunk == 0 else _causal(c, keys, q.device)
            outs.append(self._attend(q[:, :, half * c:(half + 1) * c], k[:, :, :keys], v[:, :, :keys], mask,
                                     causal=chunk == 0))
        return torch.cat(outs, dim=2)


def _causal(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk] boolean mask, True = attend: the last sq of sk positions attending causally (bottom-right)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron's RowParallelLinear, passing its own TP group to the matmul.

    megatron-core 0.16.1's forward calls the matmul with ``tp_group=None``, which looks the default group up and
    warns (``warnings.warn``) on every call; under torch.compile each warning is a graph break (a compiled layer
    fell into 9 graphs, two per row-parallel linear). Same computation, same parameters."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class HFRotaryEmbedding(RotaryEmbedding):
    """Megatron's RoPE with transformers' inverse frequencies, kept on the model's device.

    The stock module rebuilds inv_freq from (base, rotary_percent, llama3 scaling with fixed constants) and moves it
    to CUDA on every call; this one takes the exact HF frequencies (any rope_type without attention scaling) and
    stays where it was built. A frequency vector shorter than head_dim / 2 gives partial RoPE (GLM-4).

    Context parallelism is megatron's own: GPTModel asks for the embedding of the global length (local length x cp,
    ``get_rotary_seq_len``) and ``forward`` keeps this CP rank's chunks r and 2cp-1-r (``get_pos_emb_on_this_cp_rank``,
    the layout of context_parallel.py), so each token rotates by its global position. That function pins host
    memory and copies its index to CUDA; on the host the same selection is ``split_sequence``."""

    def __init__(self, inv_freq: torch.Tensor, rotary_interleaved: bool, cp_group=None):
        super().__init__(kv_channels=2 * inv_freq.numel(), rotary_percent=1.0, rotary_interleaved=rotary_interleaved,
                         use_cpu_initialization=True, cp_group=cp_group)
        self.inv_freq = inv_freq

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        cp_group = self.cp_group if cp_group is None else cp_group
        if self.inv_freq.is_cuda or packed_seq or cp_group is None or cp_group.size() == 1:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        return split_sequence(self.get_emb(max_seq_len, offset), 0, cp_group.rank(), cp_group.size())

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, rotary_dim / 2]
        if self.rotary_interleaved:  # f0 f0 f1 f1 ... pairs (x0, x1), (x2, x3) rotate together
            emb = freqs.repeat_interleave(2, dim=-1)
        else:  # f0 f1 ... f0 f1 ...: x_i rotates with x_{i + d/2}
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


class GatedMLP(MLP):
    """megatron's dense MLP, its SwiGLU reading fc1's output [.., 2I] as a [.., 2, I] view (gate, up) where megatron
    chunks it in two. Same arithmetic. The point is the backward: a chunk's gradient is a concatenation, for which
    inductor (torch 2.11) wrote the gate half's fp32 gradient to memory and read it back. On one H200 at 8,192
    tokens and I = 4,864 the backward took two kernels of 112 + 90 us a layer, and now one of 133 us; the forward
    went from 57 to 80 us, so a layer saves ~45 us. The SwiGLU is model.transformer_config's (silu, gated, no
    bias-activation fusion, no clamp or offset); a per-token scale (megatron passes one to experts only) runs
    megatron's forward."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        hidden, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            hidden = hidden + bias
        gate_up = hidden.unflatten(-1, (2, -1))
        return self.linear_fc2(torch.nn.functional.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])


class PostNormBiasDropoutAdd(torch.nn.Module):
    """GLM-4's sandwich norm: residual + RMSNorm(sublayer output), in the layer's bias-dropout-add slot."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, training: bool, fused: bool):
        inner = get_bias_dropout_add(training, fused)

        def apply(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                raise ValueError("a sublayer bias before the post-norm is not part of GLM-4")
            return inner((self.norm(x), None), residual, prob)

        return apply


def layer_spec(arch, config, use_te: bool, moe: bool = False) -> ModuleSpec:
    """One decoder layer's spec for this architecture (see the module docstring for the choice); ``moe``: its MLP
    is megatron's MoE layer (``mlp_spec``). Multi-latent attention's layers are mla.latent_layer_spec's."""
    experts = dict(num_experts=arch.num_experts, moe_grouped_gemm=use_te) if moe else {}
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm, **experts)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm", **experts)
        spec.submodules.self_attention.module = SelfAttention
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        spec.submodules.self_attention.submodules.linear_proj = RowParallelLinear
    return mlp_spec(spec, arch, config, use_te, moe)


def mlp_spec(spec: ModuleSpec, arch, config, use_te: bool, moe: bool) -> ModuleSpec:
    """A layer spec from megatron's builders (which make a fresh one on every call: edited in place) with this
    backend's MLP: dense of ffn_hidden_size, or megatron's MoE layer (moe.MoE: its router and experts, this
    backend's token movement; experts as moe.GroupedExperts (SequentialMLP's parameters, grouped matmuls), or
    TEGroupedMLP with TransformerEngine; shared experts when the architecture has them); and GLM-4's post norms."""
    if moe:
        spec.submodules.mlp.module = MoE
        spec.submodules.mlp.submodules.router = Router
        if not use_te:  # TEGroupedMLP's grouped GEMM, or ours
            spec.submodules.mlp.submodules.experts.module = GroupedExperts
        if not arch.moe_shared_ffn_hidden_size:
            spec.submodules.mlp.submodules.shared_experts = None
        elif not use_te:
            spec.submodules.mlp.submodules.shared_experts.submodules.linear_fc2 = RowParallelLinear
    else:
        spec.submodules.mlp.params = {**spec.submodules.mlp.params, "ffn_hidden_size": config.ffn_hidden_size}
        if not use_te:
            spec.submodules.mlp.module = GatedMLP
            spec.submodules.mlp.submodules.linear_fc2 = RowParallelLinear
    if arch.sandwich_norm:
        post_norm = ModuleSpec(module=PostNormBiasDropoutAdd,
                               params={"hidden_size": config.hidden_size, "eps": config.layernorm_epsilon})
        spec.submodules.self_attn_bda = post_norm
        spec.submodules.mlp_bda = post_norm
    return spec


def block_spec(arch, config, use_te: bool, layer=layer_spec) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder layers (megatron's split of ``num_layers`` over the PP ranks; each layer's
    MLP dense or MoE by its global number, arch.moe_layers) plus the final norm (explicit, so it is torch's RMSNorm
    or TENorm, never apex's). ``layer(arch, config, use_te, moe)``: one layer's spec (layer_spec, or
    mla.latent_layer_spec)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = WrappedTorchNorm
    offset = get_transformer_layer_offset(config)
    layers = [layer(arch, config, use_te, moe=offset + i in arch.moe_layers)
              for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


class ValueHead(torch.nn.Module):
    """The PPO critic's head in GPTModel's output-layer slot: V = h w^T + b per position ([s, b, H] -> [s, b, 1]),
    the same full weights on every TP rank (hidden states are not split across TP). Called as megatron calls its
    output layer, ``(hidden, weight=None, runtime_gather_output=None) -> (values, None)``; parameters
    ``output_layer.{weight [1, H], bias [1]}`` <-> HF *ForTokenClassification ``score.{weight, bias}``."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None
