"""algo.true_on_policy for train=megatron: megatron's dense layers computing the batch-invariant forward of
model/invariant.py, so the trainer's logprobs equal the embedded engine's bit for bit (tests/train/
test_true_on_policy.py runs both backends).

The engine runs transformers' modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, RMSNorms, the
LM head) through ``tiled_linear``, ``rms_norm`` and the decode-form attention. megatron holds the same weights in
other shapes: q, k and v rows interleaved per query group in one ``linear_qkv`` (convert.py), gate and up stacked in
``linear_fc1``. A wider matmul is another GEMM shape, whose rounding may differ, so each projection here is its own
tiled matmul of exactly the engine's weight (the q rows gathered into one contiguous [heads x d, H] matrix, as
q_proj holds them); gate/up stay one matmul only for a family whose transformers module is fused (GLM-4's
gate_up_proj). RoPE is spec.py's (``rotate``: transformers' x cos + rotate_half(x) sin, tables of the same
cos/sin), the residual adds and SwiGLU are the same elementwise operations. The embedding lookup is exact as it is.

Covered: tensor, pipeline, context and expert parallelism of 1 (a row-parallel matmul over TP ranks ends in an
all-reduce that adds partial sums in NCCL's order: docs/loop.md), dense families with standard attention; not
multi-latent attention or MoE layers, not TransformerEngine's spec (its fused norm-linear is other code): the backend
refuses those, pre-flight by key (config/backend_rules.py).
"""

import types
from typing import Optional

import torch
import torch.nn.functional as F

from slime_hydra.model.invariant import DecodeFormAttention, rms_norm, tiled_linear
from slime_hydra.train.kinds import PARALLEL_DIMS
from slime_hydra.train.megatron.spec import GatedMLP, PostNormBiasDropoutAdd, SelfAttention, rope_table, rotate
from slime_hydra.train.packing import sequence_positions


def _norm(self: torch.nn.RMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden, self.weight, self.eps)


def _attention(self: SelfAttention, hidden_states, attention_mask, key_value_states=None, inference_context=None,
               rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
               attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
    """Self-attention of hidden states [s, b, H] (a right-padded batch, causal; or one packed THD row) ->
    (output [s, b, H], None), as transformers' attention computes it under the batch-invariant forward."""
    if attention_mask is not None or attention_bias is not None or not isinstance(rotary_pos_emb, torch.Tensor):
        raise ValueError("algo.true_on_policy: megatron's attention takes causal rows without a mask or bias here")
    s, b = hidden_states.shape[:2]
    groups = self.num_query_groups_per_partition
    per_group = self.num_attention_heads_per_partition // groups
    d = self.hidden_size_per_attention_head
    weight = self.linear_qkv.weight.view(groups, per_group + 2, d, -1)
    bias = None if self.linear_qkv.bias is None else self.linear_qkv.bias.view(groups, per_group + 2, d)

    def projection(rows: slice) -> torch.Tensor:  # one of q, k, v: its rows as one contiguous matrix (and bias)
        w = weight[:, rows].reshape(-1, weight.shape[-1])
        return tiled_linear(hidden_states, w, None if bias is None else bias[:, rows].reshape(-1))

    query = self.q_layernorm(projection(slice(0, per_group)).view(s, b, groups * per_group, d))
    key = self.k_layernorm(projection(slice(per_group, per_group + 1)).view(s, b, groups, d))
    value = projection(slice(per_group + 1, per_group + 2)).view(s, b, groups, d)
    bounds = None
    if packed_seq_params is not None:  # each token rotates by its position in its own sequence
        rotary_pos_emb = rotary_pos_emb[sequence_positions(packed_seq_params.cu_seqlens_q, s)]
        bounds = packed_seq_params.cu_seqlens_q.tolist()
    cos, sin = rope_table(rotary_pos_emb, query.dtype)
    query = rotate(query, cos, sin, self.config.rotary_interleaved)
    key = rotate(key, cos, sin, self.config.rotary_interleaved)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    out = DecodeFormAttention.apply(q, k, v, self.core_attention.scale, bounds)  # [b, s, heads, d]
    return tiled_linear(out.transpose(0, 1).reshape(s, b, -1), self.linear_proj.weight), None


def _mlp(self: GatedMLP, hidden_states, per_token_scale=None, **kwargs):
    """SwiGLU ``down(silu(gate(x)) * up(x))``: gate and up as their own matmuls (one for a fused family)."""
    weight = self.linear_fc1.weight
    if self.fused_gate_up:
        gate, up = tiled_linear(hidden_states, weight).chunk(2, dim=-1)
    else:
        half = weight.shape[0] // 2
        gate, up = tiled_linear(hidden_states, weight[:half]), tiled_linear(hidden_states, weight[half:])
    return tiled_linear(F.silu(gate) * up, self.linear_fc2.weight), None


def _output(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
    """The LM head (the embedding's weight when tied: GPTModel passes it)."""
    return tiled_linear(input_, self.weight if weight is None else weight), None


def refuse_uncovered(train, arch) -> None:
    """ValueError naming what the batch-invariant forward does not cover here: model parallelism, MoE layers,
    multi-latent attention (pre-flight refuses the same by key: config/rules.py, config/backend_rules.py)."""
    refused = [f"train.{dim}={getattr(train, dim)}" for dim in PARALLEL_DIMS if getattr(train, dim) > 1]
    refused += ["a mixture of experts"] * arch.is_moe + ["multi-latent attention"] * arch.is_mla
    if refused:
        raise ValueError("train=megatron with algo.true_on_policy has no batch-invariant forward for "
                         + ", ".join(refused))


def make_invariant(model: torch.nn.Module, fused_gate_up: bool) -> int:
    """Put the batch-invariant forwards into a built GPTModel (local spec, TP1, dense); returns how many modules
    changed. A module of this stage that has no batch-invariant form here is refused (ValueError)."""
    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.forward = types.MethodType(_norm, module)
        elif isinstance(module, SelfAttention):
            if module.linear_proj.bias is not None:
                raise ValueError(f"algo.true_on_policy: {name} has an output-projection bias (not built)")
            module.forward = types.MethodType(_attention, module)
        elif isinstance(module, GatedMLP):
            if module.linear_fc1.bias is not None or module.linear_fc2.bias is not None:
                raise ValueError(f"algo.true_on_policy: {name} has MLP biases (not built)")
            module.fused_gate_up = fused_gate_up
            module.forward = types.MethodType(_mlp, module)
        elif name == "output_layer":
            module.forward = types.MethodType(_output, module)
        elif isinstance(module, PostNormBiasDropoutAdd):
            continue  # GLM-4's sandwich norm: its RMSNorm is a child (above), the residual add elementwise
        elif "Norm" in type(module).__name__ or "MoE" in type(module).__name__ or "Latent" in type(module).__name__:
            raise ValueError(f"algo.true_on_policy: {name} ({type(module).__name__}) has no batch-invariant form here")
        else:
            continue
        changed += 1
    return changed
