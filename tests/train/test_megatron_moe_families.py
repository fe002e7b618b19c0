"""train=megatron with the grouped-router MoE families (GLM-4.5 ``glm4_moe``) on CPU with gloo, against
transformers 5's modeling (train=fsdp).

Tiny random checkpoints (fp32; weights ~ N(0, 0.2), norms ~ U(0.8, 1.2), the router's correction bias ~ N(0, 0.1), so
the sigmoid scores are far from ties): 8 experts in 4 groups, a token choosing 4 experts in 2 groups, routed weights
scaled by 2.5, one shared expert, layer 0 dense. Measured: logits equal transformers' within 1e-4 at TP1, TP2 and EP2;
weights round-trip HF -> megatron -> HF bit for bit; the first training step's loss and grad norm equal train=fsdp's
within 1e-5 relative (three steps within 1e-4), TP2 and EP2 equal TP1, and the correction bias is not trained.

One spawned 2-rank run (~10 s to start on an idle machine) computes everything; the tests assert on its results.
Functions run on spawned ranks are module-level (pickled by name).
"""

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Glm4MoeConfig

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
CHECKPOINTS = {
    # GLM-4.5: q/k/v biases, q/k norms (GLM-4.5; GLM-4.5-Air has none), RoPE on half of each 16-wide head
    "glm4_moe": (Glm4MoeConfig, dict(GROUPED, head_dim=16, attention_bias=True, use_qk_norm=True)),
}
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
    for family, path in paths.items():
        tp2 = MegatronBackend(path, TrainConfig(**CFG, tp=2, micro_batch_samples=3), total_steps=3)
        out[family, "tp2"] = _steps(tp2, batch, 1)
        parallel_state.destroy_model_parallel()
        ep2 = MegatronBackend(path, TrainConfig(**CFG, ep=2, micro_batch_samples=3), total_steps=3)
        out[family, "ep2"] = _steps(ep2, rows.select(list(range(ep2.dp_rank, len(EP2_ROWS), ep2.dp_size))), 1)
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
])
def test_what_megatron_cannot_express_is_refused_naming_the_key(change, named):
    config_class, shape = CHECKPOINTS["glm4_moe"]
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
@pytest.mark.parametrize("family", CHECKPOINTS)
def test_training_agrees_with_fsdp_and_tp2_ep2_with_tp1(ranks, family):
    """The first step within 1e-5 relative of train=fsdp's loss and grad norm, three steps within 1e-4; TP2's and
    EP2's first step within 1e-5 of TP1's on the same rows."""
    for rank in range(2):
        megatron, fsdp = ranks[rank][family, "megatron"], ranks[rank][family, "fsdp"]
        print(f"{family} megatron vs fsdp, max relative diff: first step {_max_rel(megatron[:1], fsdp[:1]):.1e}, "
              f"three steps {_max_rel(megatron, fsdp):.1e}")
        assert _max_rel(megatron[:1], fsdp[:1]) < 1e-5 and _max_rel(megatron, fsdp) < 1e-4, (megatron, fsdp)
        assert megatron[2][0] < megatron[0][0]  # the policy-gradient loss falls
        assert _max_rel(ranks[rank][family, "tp2"], megatron[:1]) < 1e-5
        assert _max_rel(ranks[rank][family, "ep2"], ranks[rank][family, "rows7"]) < 1e-5


@pytest.mark.parametrize("family", CHECKPOINTS)
def test_weights_are_named_as_fsdp_and_the_correction_bias_is_not_trained(ranks, checkpoints, family):
    weights, fsdp = ranks[0][family, "weights"], ranks[0][family, "fsdp_weights"]
    assert set(weights) == set(fsdp)
    original = load_file(checkpoints[family] / "model.safetensors")
    biases = [n for n in original if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2
    for name in biases:
        assert torch.equal(weights[name], original[name]) and torch.equal(fsdp[name], original[name])
    assert not torch.equal(weights["model.layers.1.mlp.gate.weight"], original["model.layers.1.mlp.gate.weight"])
