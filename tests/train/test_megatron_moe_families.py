"""train=megatron with the grouped-router MoE families (GLM-4.5 ``glm4_moe``, DeepSeek-V3 ``deepseek_v3`` with
multi-latent attention) on CPU with gloo, against transformers 5's modeling (train=fsdp).

Tiny random checkpoints (fp32; weights ~ N(0, 0.2), norms ~ U(0.8, 1.2), the router's correction bias ~ N(0, 0.1), so
the sigmoid scores are far from ties): 8 experts in 4 groups, a token choosing 4 experts in 2 groups, routed weights
scaled by 2.5, one shared expert, layer 0 dense; DeepSeek-V3 with query compression and interleaved RoPE, and a
second one without query compression, with half-split RoPE (rope_interleave=False) and yarn scaling (an attention
factor != 1 and a softmax mscale). Measured: logits equal transformers' within 1e-4 at TP1, TP2 and EP2; weights
round-trip HF -> megatron -> HF bit for bit; the first training step's loss and grad norm equal train=fsdp's within
1e-5 relative (three steps within 1e-4), TP2, PP2, CP2 and EP2 equal TP1 (at TP2 MLA's shared RoPE key gathers its
gradient from every rank's heads: mla.py), and the correction bias is not trained.

One spawned 2-rank run (~10 s to start on an idle machine) computes everything; the tests assert on its results.
Functions run on spawned ranks are module-level (pickled by name).
"""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

from slime_hydra.train.config import TrainConfig
from slime_hydra.train.megatron.convert import param_map
from slime_hydra.train.megatron.model import Arch
from tests.train.harness import pg_loss, run_ranks, toy_batch

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0)
GROUPED = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, n_routed_experts=8, num_experts_per_tok=4,
               n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
               num_hidden_layers=3, tie_word_embeddings=False)
"""The grouped router's shape, shared by the families."""
LATENT = dict(GROUPED, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12)
"""Multi-latent attention: 4 heads, queries from a 24-wide latent, keys/values from a 16-wide one, query/key heads of
16 + 8 (RoPE) channels, value heads of 12."""
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
"""yarn with mscale != mscale_all_dim: cos/sin scaled by transformers' attention factor (1.04), the softmax by
mscale(4, 0.8)^2."""
CHECKPOINTS = {
    # GLM-4.5: q/k/v biases, q/k norms (GLM-4.5; GLM-4.5-Air has none), RoPE on half of each 16-wide head
    "glm4_moe": (Glm4MoeConfig, dict(GROUPED, head_dim=16, attention_bias=True, use_qk_norm=True)),
    "deepseek_v3": (DeepseekV3Config, LATENT),
    "deepseek_v3_yarn": (DeepseekV3Config, dict(LATENT, q_lora_rank=None, rope_interleave=False,
                                                rope_parameters=YARN)),
}
TRAINED = ("glm4_moe", "deepseek_v3")
"""The checkpoints trained on both backends (all are converted)."""
EP2_ROWS = list(range(7))
"""The EP2 step's batch: 7 rows, DP rank 0 gets 4 (two micro-batches of <= 3), rank 1 three (one, plus an empty one)."""


def family_checkpoint(family: str) -> Path:
    """A random checkpoint of ``family`` (safetensors, per-expert tensors as on the Hub)."""
    config_class, shape = CHECKPOINTS[family]
    out = Path(tempfile.mkdtemp(prefix=f"tiny_{family}_"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**shape), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints():
    return {family: family_checkpoint(family) for family in CHECKPOINTS}


# ---- ranks' work --------------------------------------------------------------------------------------------
def _steps(backend, batch, n):
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(batch, pg_loss) for _ in range(n))]


def _logits_and_weights(path, tp, ep):
    """Full-vocabulary logits of a fixed batch and the HF checkpoint tensors exported from a fresh GPTModel."""
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_hydra.train.megatron.model import build_model, transformer_config

    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(arch, transformer_config(arch, tp=tp, ep=ep))
    load_hf_weights(model, path, arch)
    model.eval()
    ids = torch.randint(0, GROUPED["vocab_size"], (3, 13), generator=torch.Generator().manual_seed(1))
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        local = model(ids, torch.arange(13).expand_as(ids), None)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    ep_group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None
    weights = {name: t.clone() for name, t in iter_hf_weights(model, arch, group, ep_group=ep_group)}
    return ids, torch.cat(parts, dim=-1), weights


def _ranks(rank, world, paths):
    """Everything, on two ranks: the conversions at TP2, EP2 and TP1 (two replicas); then per family TP2's and EP2's
    first step, and three steps of megatron and of fsdp at DP2 with both ranks given the whole batch (the step of
    the batch's mean, as on one rank: loss scaling counts the units of every DP rank)."""
    from megatron.core import parallel_state

    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.megatron.backend import MegatronBackend
    from slime_hydra.train.megatron.model import init_parallel

    out, batch, rows = {}, toy_batch(), toy_batch().select(EP2_ROWS)
    for tp, ep in ((2, 1), (1, 2), (1, 1)):
        init_parallel(tp, ep=ep)
        out[tp, ep] = {family: _logits_and_weights(path, tp, ep) for family, path in paths.items()}
        parallel_state.destroy_model_parallel()
    for family in TRAINED:
        path = paths[family]
        tp2 = MegatronBackend(path, TrainConfig(**CFG, tp=2, micro_batch_samples=3), total_steps=3)
        out[family, "tp2"] = _steps(tp2, batch, 1)
        parallel_state.destroy_model_parallel()
        ep2 = MegatronBackend(path, TrainConfig(**CFG, ep=2, micro_batch_samples=3), total_steps=3)
        out[family, "ep2"] = _steps(ep2, rows.select(list(range(ep2.dp_rank, len(EP2_ROWS), ep2.dp_size))), 1)
        parallel_state.destroy_model_parallel()
        for name, parallel in (("pp2", dict(pp=2, megatron={"num_layers_in_first_pipeline_stage": 2})),
                               ("cp2", dict(cp=2))):
            backend = MegatronBackend(path, TrainConfig(**CFG, **parallel, micro_batch_samples=3), total_steps=3)
            out[family, name] = _steps(backend, batch, 1)
            parallel_state.destroy_model_parallel()
        megatron = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
        out[family, "megatron"] = _steps(megatron, batch, 3)
        out[family, "weights"] = {name: t.clone() for name, t in megatron.iter_full_weights()}
        parallel_state.destroy_model_parallel()
        whole_rows = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=3)
        out[family, "rows7"] = _steps(whole_rows, rows, 1)
        parallel_state.destroy_model_parallel()
        fsdp = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
        out[family, "fsdp"] = _steps(fsdp, batch, 3)
        out[family, "fsdp_weights"] = {name: t.clone() for name, t in fsdp.iter_full_weights()}
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints):
    return run_ranks(2, _ranks, checkpoints)


def _max_rel(got, want):
    """The largest relative difference between [(loss, grad_norm)] per step and the reference."""
    assert len(got) == len(want)
    return max(abs(a - b) / abs(b) for g, w in zip(got, want) for a, b in zip(g, w))


# ---- architecture and conversion ----------------------------------------------------------------------------
def test_arch_reads_the_grouped_router_fields(checkpoints):
    arch = Arch.from_hf(AutoConfig.from_pretrained(checkpoints["glm4_moe"]))
    assert (arch.num_experts, arch.moe_top_k, arch.moe_groups, arch.moe_group_top_k) == (8, 4, 4, 2)
    assert (arch.moe_score, arch.moe_expert_bias, arch.moe_scaling, arch.moe_norm_topk) == ("sigmoid", True, 2.5, True)
    assert (arch.moe_layers, arch.moe_shared_ffn_hidden_size, arch.ffn_hidden_size) == ((1, 2), 32, 96)
    assert arch.qkv_bias and arch.qk_norm and not arch.rotary_interleaved and arch.inv_freq.numel() == 4  # 16 / 2 / 2
    names = {p.megatron: p for p in param_map(arch)}
    assert names["decoder.layers.1.mlp.router.expert_bias"].hf == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    shared = names["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"]
    assert shared.hf == ("model.layers.2.mlp.shared_experts.gate_proj.weight",
                         "model.layers.2.mlp.shared_experts.up_proj.weight") and shared.expert is None
    assert names["decoder.layers.0.mlp.linear_fc1.weight"].hf == ("model.layers.0.mlp.gate_proj.weight",
                                                                  "model.layers.0.mlp.up_proj.weight")


def test_arch_reads_multi_latent_attention(checkpoints):
    arch = Arch.from_hf(AutoConfig.from_pretrained(checkpoints["deepseek_v3"]))
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim,
            arch.head_dim, arch.rope_interleave) == (24, 16, 16, 8, 12, 24, True)
    assert arch.is_mla and arch.inv_freq.numel() == 4 and (arch.rope_scaling_factor, arch.mscale_all_dim) == (1.0, 0.0)
    assert (arch.moe_layers, arch.moe_groups, arch.moe_shared_ffn_hidden_size) == ((1, 2), 4, 32)
    yarn = Arch.from_hf(AutoConfig.from_pretrained(checkpoints["deepseek_v3_yarn"]))
    assert (yarn.q_lora_rank, yarn.rope_interleave, yarn.rope_scaling_factor, yarn.mscale_all_dim) == (0, False, 4.0, 0.8)
    assert yarn.rope_attention_scaling == pytest.approx((0.1 * math.log(4) + 1) / (0.08 * math.log(4) + 1))
    names = {p.megatron: p for p in param_map(arch)}
    assert names["decoder.layers.0.self_attention.linear_q_up_proj.weight"].hf == (
        "model.layers.0.self_attn.q_b_proj.weight",)
    assert names["decoder.layers.2.self_attention.linear_kv_down_proj.weight"].kind == "latent_kv"
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in {p.megatron for p in param_map(yarn)}


def test_megatron_yarn_formulas_reproduce_transformers_for_deepseek_v3():
    """DeepSeek-V3's own rope_scaling (factor 40 from 4096 positions, mscale = mscale_all_dim = 1): megatron-core's
    yarn (YarnRotaryEmbedding's correction range, ramp and concentration factor; MLA's softmax mscale) gives
    transformers' inverse frequencies, attention factor and softmax scale. (YarnRotaryEmbedding itself moves its
    tables to CUDA, so train=megatron applies transformers' frequencies: mla.LatentRotary.)"""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range, _yarn_get_concentration_factor, _yarn_get_mscale, _yarn_linear_ramp_mask)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    config = DeepseekV3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, q_lora_rank=16,
                              kv_lora_rank=16, max_position_embeddings=163840, rope_parameters=rope)
    hf = DeepseekV3RotaryEmbedding(config)
    dim, base = config.qk_rope_head_dim, 10000.0
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    low, high = _yarn_find_correction_range(32, 1, dim, base, 4096)
    mask = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device="cpu")
    megatron = extra / 40.0 * (1 - mask) + extra * mask
    torch.testing.assert_close(megatron, hf.inv_freq, rtol=1e-6, atol=0)
    assert _yarn_get_concentration_factor(40.0, 1.0, 1.0) == pytest.approx(hf.attention_scaling, rel=1e-12)
    softmax = _yarn_get_mscale(40.0, 1.0) ** 2 / math.sqrt(config.qk_head_dim)
    assert softmax == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)


def test_megatron_config_is_the_grouped_sigmoid_router(checkpoints):
    from slime_hydra.train.megatron.model import transformer_config

    config = transformer_config(Arch.from_hf(AutoConfig.from_pretrained(checkpoints["glm4_moe"])))
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
            config.moe_router_bias_update_rate, config.moe_router_num_groups, config.moe_router_group_topk,
            config.moe_router_topk_scaling_factor, config.moe_shared_expert_intermediate_size,
            config.moe_router_dtype) == ("sigmoid", True, 0.0, 4, 2, 2.5, 32, "fp32")


@pytest.mark.parametrize("change,named", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(topk_group=1), "n_group=4 with topk_group=1 and num_experts_per_tok=4"),  # 4 // 1 = 4 experts score a group
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1), "num_experts_per_tok=1"),
    (dict(attention_bias=True), "attention_bias=True (biases on q_a_proj"),  # DeepSeek-V3's
])
def test_what_megatron_cannot_express_is_refused_naming_the_key(change, named):
    config_class, shape = CHECKPOINTS["glm4_moe" if "attention_bias" not in change else "deepseek_v3"]
    with pytest.raises(ValueError, match="not expressible by train=megatron") as error:
        Arch.from_hf(config_class(**{**shape, **change}))
    assert named in str(error.value)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "ep2"])
@pytest.mark.parametrize("family", CHECKPOINTS)
def test_megatron_logits_equal_transformers_and_weights_round_trip(ranks, checkpoints, family, tp, ep):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32)
    original = load_file(checkpoints[family] / "model.safetensors")
    for rank in range(2):
        ids, logits, weights = ranks[rank][tp, ep][family]
        with torch.no_grad():
            gap = (logits - hf(ids).logits).abs().max().item()
        print(f"{family} tp={tp} ep={ep} rank {rank}: max |logit diff| {gap:.2e}")
        assert gap < 1e-4, (family, tp, ep, gap)
        assert set(weights) == set(original)
        for name, tensor in original.items():
            assert torch.equal(weights[name], tensor), (family, tp, ep, name)


# ---- training ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", TRAINED)
def test_training_agrees_with_fsdp_and_tp2_ep2_with_tp1(ranks, family):
    """The first step within 1e-5 relative of train=fsdp's loss and grad norm, three steps within 1e-4; TP2's, PP2's
    (layers 0-1 | 2), CP2's and EP2's first step within 1e-5 of TP1's on the same rows."""
    for rank in range(2):
        megatron, fsdp = ranks[rank][family, "megatron"], ranks[rank][family, "fsdp"]
        print(f"{family} megatron vs fsdp, max relative diff: first step {_max_rel(megatron[:1], fsdp[:1]):.1e}, "
              f"three steps {_max_rel(megatron, fsdp):.1e}")
        assert _max_rel(megatron[:1], fsdp[:1]) < 1e-5 and _max_rel(megatron, fsdp) < 1e-4, (megatron, fsdp)
        assert megatron[2][0] < megatron[0][0]  # the policy-gradient loss falls
        for name in ("tp2", "pp2", "cp2"):
            assert _max_rel(ranks[rank][family, name], megatron[:1]) < 1e-5, (name, ranks[rank][family, name])
        assert _max_rel(ranks[rank][family, "ep2"], ranks[rank][family, "rows7"]) < 1e-5


@pytest.mark.parametrize("family", TRAINED)
def test_weights_are_named_as_fsdp_and_the_correction_bias_is_not_trained(ranks, checkpoints, family):
    weights, fsdp = ranks[0][family, "weights"], ranks[0][family, "fsdp_weights"]
    assert set(weights) == set(fsdp)
    original = load_file(checkpoints[family] / "model.safetensors")
    biases = [n for n in original if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2
    for name in biases:
        assert torch.equal(weights[name], original[name]) and torch.equal(fsdp[name], original[name])
    assert not torch.equal(weights["model.layers.1.mlp.gate.weight"], original["model.layers.1.mlp.gate.weight"])
