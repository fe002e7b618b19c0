"""train=megatron with Qwen3-MoE (megatron-core's MoELayer: TopKRouter, SequentialMLP experts) on CPU with gloo.

Tiny random Qwen3-MoE checkpoints (transformers' Qwen3MoeConfig, fp32): logits equal transformers' at TP1, TP2
and EP2 (dense and sparse layers mixed; norm_topk_prob on and off); weights round-trip HF -> megatron -> HF bit for
bit at each; a training step's loss and grad norm equal train=fsdp's (transformers' modeling) and TP1's at TP2,
PP2, CP2 and EP2 (the latter with DP ranks of unequal micro-batch counts), and on 4 ranks at TP2xEP2, EP2xPP2,
EP4xCP2, EP2xCP2 and EP2xCP2xPP2 (logprobs, three steps, every weight on every rank, checkpoint resume); export_hf
and an EP2 checkpoint resume; LoRA on the attention agrees with fsdp's and at EP2.
The router's load-balancing loss is off everywhere (coefficient 0, the default): transformers adds its own only with
output_router_logits and labels, which train=fsdp never passes.

Spawned processes cost ~10 s each on the 2-core machine, so a few module-scoped runs compute everything and the
tests assert on their results. Functions run on spawned ranks are module-level (pickled by name).
"""

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

from slime_hydra.train.config import LoraConfig, TrainConfig
from slime_hydra.train.megatron.convert import hf_to_megatron, megatron_to_hf, param_map
from slime_hydra.train.megatron.model import Arch
from tests.train.harness import pg_loss, run_ranks, toy_batch

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0)
AUX_CFG = dict(CFG, megatron={"moe_aux_loss_coeff": 0.1})
"""megatron's load-balancing loss on (train.megatron passthrough)."""
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
             tie_word_embeddings=False)
CHECKPOINTS = {
    # layer 1 dense (mlp_only_layers), top-k renormalised: the training checkpoint
    "mixed": dict(num_hidden_layers=4, mlp_only_layers=[1], norm_topk_prob=True),
    # every second layer sparse (decoder_sparse_step), raw softmax probabilities of the top k
    "sparse_step": dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False),
}
TRAIN = "mixed"
LORA = LoraConfig(rank=4, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
"""LoRA on a MoE model adapts its attention (the experts are fused tensors PEFT does not adapt)."""
EP2_ROWS = list(range(7))
"""The EP2 step's batch: 7 rows, so DP rank 0 has 4 (2 micro-batches of <= 3) and rank 1 has 3 (one): the EP peers
must still run the same number of micro-batches."""


def moe_checkpoint(name: str) -> Path:
    """A random Qwen3-MoE checkpoint (safetensors, per-expert tensors as on the Hub). Weights ~ N(0, 0.2) and norms
    ~ U(0.8, 1.2), so router logits are far from ties (transformers' init of 0.02 leaves top-k near-random)."""
    out = Path(tempfile.mkdtemp(prefix=f"tiny_qwen3_moe_{name}_"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE, **CHECKPOINTS[name]), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints():
    return {name: moe_checkpoint(name) for name in CHECKPOINTS}


# ---- ranks' work --------------------------------------------------------------------------------------------
def _logits_and_weights(path, tp, ep):
    """Full-vocabulary logits of a fixed batch and the HF checkpoint tensors exported from a fresh GPTModel."""
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_hydra.train.megatron.model import build_model, transformer_config

    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(arch, transformer_config(arch, tp=tp, ep=ep))
    load_hf_weights(model, path, arch)
    model.eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 13), generator=torch.Generator().manual_seed(1))
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        local = model(ids, torch.arange(13).expand_as(ids), None)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    ep_group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None
    weights = {name: t.clone() for name, t in iter_hf_weights(model, arch, group, ep_group=ep_group)}
    experts = sorted({int(n.split("local_experts.")[1].split(".")[0])
                      for n, _ in model.named_parameters() if "local_experts." in n})
    indices = model.decoder.layers[arch.moe_layers[0]].mlp.local_expert_indices
    return ids, torch.cat(parts, dim=-1), weights, experts, indices


def _convert(rank, world, paths):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.model import init_parallel

    out = {}
    for tp, ep in ((2, 1), (1, 2), (1, 1)):  # (1, 1) on 2 ranks: two data-parallel replicas
        init_parallel(tp, ep=ep)
        out[tp, ep] = {name: _logits_and_weights(path, tp, ep) for name, path in paths.items()}
        parallel_state.destroy_model_parallel()
    return out


def _steps(backend, batch, n=3):
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(batch, pg_loss) for _ in range(n))]


def _one_rank(rank, world, path, export):
    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    megatron = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
    out["logp"] = megatron.logprobs(batch, temperature=0.7, with_entropy=True)
    out["tp1"] = _steps(megatron, batch)
    out["weights"] = {name: t.clone() for name, t in megatron.iter_full_weights()}
    megatron.export_hf(export)
    split = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=3)
    out["tp1_micro3"] = _steps(split, batch)
    seven = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=3)
    out["tp1_rows7_logp"] = seven.logprobs(batch.select(EP2_ROWS))[0]
    out["tp1_rows7"] = _steps(seven, batch.select(EP2_ROWS), 1)
    out["tp1_rows7_weights"] = {name: t.clone() for name, t in seven.iter_full_weights()}
    out["tp1_rows7"] += _steps(seven, batch.select(EP2_ROWS), 2)
    fsdp = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
    out["fsdp_logp"] = fsdp.logprobs(batch, temperature=0.7, with_entropy=True)
    out["fsdp"] = _steps(fsdp, batch)
    out["fsdp_weights"] = {name: t.clone() for name, t in fsdp.iter_full_weights()}
    aux = MegatronBackend(path, TrainConfig(**AUX_CFG, micro_batch_samples=3), total_steps=1)
    out["aux_tp1"] = _steps(aux, batch, 1)
    fsdp_lora = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=8, lora=LORA), total_steps=3)
    fsdp_lora.export_adapter(Path(export) / "lora_init")
    out["fsdp_lora"] = _steps(fsdp_lora, batch)
    megatron_lora = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=8, lora=LORA), total_steps=3)
    megatron_lora.load_adapter(Path(export) / "lora_init")
    out["megatron_lora"] = _steps(megatron_lora, batch)
    seven_lora = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3, lora=LORA), total_steps=2)
    out["tp1_rows7_lora"] = _steps(seven_lora, batch.select(EP2_ROWS), 2)
    out["refused"] = []
    for bad in (dict(CFG, ep=2), dict(CFG, lora=LoraConfig(rank=4))):
        try:
            MegatronBackend(path, TrainConfig(**bad), total_steps=1)
            out["refused"].append(None)
        except ValueError as error:
            out["refused"].append(str(error))
    return out


def _two_ranks(rank, world, path, ckpt):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.backend import MegatronBackend

    out, batch = {}, toy_batch()
    tp2 = MegatronBackend(path, TrainConfig(**CFG, tp=2, micro_batch_samples=3), total_steps=3)
    out["tp2_logp"] = tp2.logprobs(batch, temperature=0.7, with_entropy=True)
    out["tp2"] = _steps(tp2, batch)
    parallel_state.destroy_model_parallel()
    for name, parallel in (("pp2", dict(pp=2)), ("cp2", dict(cp=2))):
        backend = MegatronBackend(path, TrainConfig(**CFG, **parallel, micro_batch_samples=3), total_steps=3)
        out[name] = _steps(backend, batch)
        parallel_state.destroy_model_parallel()
    for name, parallel in (("aux_tp2", dict(tp=2)), ("aux_pp2", dict(pp=2))):
        aux = MegatronBackend(path, TrainConfig(**AUX_CFG, **parallel, micro_batch_samples=3), total_steps=1)
        out[name] = _steps(aux, batch, 1)
        parallel_state.destroy_model_parallel()

    train = TrainConfig(**CFG, ep=2, micro_batch_samples=3)
    ep2 = MegatronBackend(path, train, total_steps=3)
    rows = batch.select(EP2_ROWS[ep2.dp_rank::ep2.dp_size])
    out["ep2_ranks"] = ep2.ep_rank, ep2.dp_rank, ep2.dp_size, len(ep2._micro_batches(rows))
    out["ep2_logp"] = ep2.logprobs(rows)[0]
    out["ep2"] = _steps(ep2, rows, 1)
    ep2.save(ckpt)
    out["ep2_next"] = _steps(ep2, rows, 2)
    out["ep2_weights"] = {name: t.clone() for name, t in ep2.iter_full_weights()}
    resumed = MegatronBackend(path, train, total_steps=3)
    resumed.load(ckpt)
    out["ep2_resumed"] = _steps(resumed, rows, 2)
    parallel_state.destroy_model_parallel()
    ep2_lora = MegatronBackend(path, TrainConfig(**CFG, ep=2, micro_batch_samples=3, lora=LORA), total_steps=2)
    out["ep2_lora"] = _steps(ep2_lora, batch.select(EP2_ROWS[ep2_lora.dp_rank::ep2_lora.dp_size]), 2)
    return out


@pytest.fixture(scope="module")
def converted(checkpoints):
    return run_ranks(2, _convert, checkpoints)


@pytest.fixture(scope="module")
def one_rank(checkpoints, tmp_path_factory):
    export = tmp_path_factory.mktemp("moe_export")
    return run_ranks(1, _one_rank, checkpoints[TRAIN], export)[0], export


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    return run_ranks(2, _two_ranks, checkpoints[TRAIN], tmp_path_factory.mktemp("moe_ckpt"))


def _close(got, want, rel):
    """[(loss, grad_norm)] per step, each within rel (relative) of the reference."""
    return len(got) == len(want) and all(abs(a - b) <= rel * abs(b) for g, w in zip(got, want) for a, b in zip(g, w))


def _max_rel(got, want):
    return max(abs(a - b) / abs(b) for g, w in zip(got, want) for a, b in zip(g, w))


# ---- architecture and conversion ----------------------------------------------------------------------------
def test_arch_reads_the_moe_fields_of_the_hf_config(checkpoints):
    mixed = Arch.from_hf(AutoConfig.from_pretrained(checkpoints["mixed"]))
    assert (mixed.num_experts, mixed.moe_top_k, mixed.moe_ffn_hidden_size, mixed.ffn_hidden_size) == (4, 2, 32, 96)
    assert mixed.moe_layers == (0, 2, 3) and mixed.moe_norm_topk and mixed.qk_norm and mixed.moe_aux_loss_coeff == 0
    sparse = Arch.from_hf(AutoConfig.from_pretrained(checkpoints["sparse_step"]))
    assert sparse.moe_layers == (1, 3) and not sparse.moe_norm_topk  # (i + 1) % decoder_sparse_step == 0
    names = {p.megatron: p for p in param_map(mixed)}
    assert names["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
    fc1 = names["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight")
    assert (fc1.kind, fc1.expert) == ("gate_up", 3)
    assert names["decoder.layers.1.mlp.linear_fc1.weight"].kind == "gate_up"  # the dense layer


def test_conversion_shards_experts_like_the_dense_mlp_for_any_tp(checkpoints):
    path = checkpoints[TRAIN]
    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    hf = load_file(path / "model.safetensors")
    for tp in (1, 2, 4):
        per_rank = [hf_to_megatron(hf, arch, r, tp) for r in range(tp)]
        fc1 = per_rank[0]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
        assert fc1.shape == (2 * 32 // tp, 64)  # [gate rows of r; up rows of r]
        back = megatron_to_hf(per_rank, arch)
        assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "ep2"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_megatron_moe_logits_equal_hf_logits(converted, checkpoints, name, tp, ep):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    for rank in range(2):
        ids, logits, _, experts, indices = converted[rank][tp, ep][name]
        with torch.no_grad():
            expected = hf(ids).logits
        assert (logits - expected).abs().max() < 1e-4, (name, tp, ep, (logits - expected).abs().max())
        if ep == 2:  # expert e on EP rank e // (E / ep): each rank holds two, numbered 0, 1 locally
            assert experts == [0, 1] and indices == [2 * rank, 2 * rank + 1]


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "ep2"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_weights_round_trip_hf_megatron_hf_bit_for_bit(converted, checkpoints, name, tp, ep):
    """Every rank gets every checkpoint tensor (EP2: the other rank's experts by broadcast), equal to the file's."""
    original = load_file(checkpoints[name] / "model.safetensors")
    for rank in range(2):
        weights = converted[rank][tp, ep][name][2]
        assert set(weights) == set(original)
        for n, tensor in original.items():
            assert torch.equal(weights[n], tensor), (name, tp, ep, n)


# ---- the backend --------------------------------------------------------------------------------------------
def test_megatron_moe_step_agrees_with_fsdp(one_rank):
    """The same weights and batch, aux loss off on both: the first step's loss and grad norm within 1e-5
    relative; three AdamW steps within 1%; logprobs and entropy (temperature 0.7) within 1e-5."""
    out, _ = one_rank
    assert _close(out["tp1"][:1], out["fsdp"][:1], 1e-5), (out["tp1"], out["fsdp"])
    assert _close(out["tp1"], out["fsdp"], 1e-2), (out["tp1"], out["fsdp"], _max_rel(out["tp1"], out["fsdp"]))
    for mine, theirs in zip(out["logp"], out["fsdp_logp"]):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert out["tp1"][2][0] < out["tp1"][0][0]  # the policy-gradient loss falls


def test_full_weights_are_named_as_transformers_and_export_reloads(one_rank, checkpoints):
    """iter_full_weights gives transformers' in-memory names (stacked experts), as train=fsdp does; export_hf
    writes a checkpoint transformers loads to the same tensors, per-expert on disk like the original."""
    out, export = one_rank
    weights = out["weights"]
    assert set(weights) == set(out["fsdp_weights"])
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    assert set(exported) == set(weights)
    for n, tensor in weights.items():
        assert torch.equal(exported[n], tensor), n
    assert set(load_file(export / "model.safetensors")) == set(load_file(checkpoints[TRAIN] / "model.safetensors"))
    original = AutoModelForCausalLM.from_pretrained(checkpoints[TRAIN], dtype=torch.float32).state_dict()
    assert not torch.equal(original["model.layers.0.mlp.experts.down_proj"],
                           weights["model.layers.0.mlp.experts.down_proj"])  # trained


def test_micro_batches_tp2_pp2_and_cp2_equal_tp1(one_rank, two_ranks):
    """Three steps on the same batch: the first step's loss and grad norm within 1e-5 relative, all three within
    1e-4 (micro-batches of 3 rows; TP2 on 8 rows at once; PP2 (layers 0-1 | 2-3) and CP2 with micro-batches of 3)."""
    out, _ = one_rank
    tp1 = out["tp1"]
    runs = [("micro3", out["tp1_micro3"])] + [(f"{name} rank {r}", two_ranks[r][name])
                                             for name in ("tp2", "pp2", "cp2") for r in range(2)]
    for name, got in runs:
        assert _close(got[:1], tp1[:1], 1e-5), (name, got, tp1)
        assert _close(got, tp1, 1e-4), (name, got, tp1)
    for rank in range(2):
        for mine, want in zip(two_ranks[rank]["tp2_logp"], out["logp"]):
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)


def test_ep2_logprobs_and_step_equal_tp1(one_rank, two_ranks):
    """EP2 on two ranks (DP2: each its rows; experts 0-1 on rank 0, 2-3 on rank 1; rank 1 runs an empty
    micro-batch to match rank 0's two): logprobs of each rank's rows and the global step equal TP1's."""
    out, _ = one_rank
    for rank in range(2):
        ep_rank, dp_rank, dp_size, micro = two_ranks[rank]["ep2_ranks"]
        assert (ep_rank, dp_rank, dp_size, micro) == (rank, rank, 2, 2)
        logp, want = two_ranks[rank]["ep2_logp"], out["tp1_rows7_logp"][rank::2]  # [rows, T of its own rows]
        torch.testing.assert_close(logp, want[:, :logp.shape[1]], atol=1e-5, rtol=0)
        assert torch.all(want[:, logp.shape[1]:] == 0)
        assert _close(two_ranks[rank]["ep2"], out["tp1_rows7"][:1], 1e-5), (two_ranks[rank]["ep2"], out["tp1_rows7"])
    assert two_ranks[0]["ep2_weights"].keys() == out["weights"].keys()
    for n, tensor in two_ranks[0]["ep2_weights"].items():  # every rank gathers every expert
        assert torch.equal(tensor, two_ranks[1]["ep2_weights"][n]), n


EP_ON_FOUR_RANKS = {
    # name: parallelism, each rank's (TP, PP, CP, DP, EP) ranks (megatron's order tp-cp-ep-dp-pp; its expert grid
    # tp-ep-dp-pp folds CP into EP x expert-DP) and micro-batch count
    "tp2_ep2": (dict(tp=2, ep=2), [(0, 0, 0, 0, 0), (1, 0, 0, 0, 0), (0, 0, 0, 1, 1), (1, 0, 0, 1, 1)], [2, 2, 2, 2]),
    "ep2_pp2": (dict(pp=2, ep=2), [(0, 0, 0, 0, 0), (0, 0, 0, 1, 1), (0, 1, 0, 0, 0), (0, 1, 0, 1, 1)], [2, 2, 2, 2]),
    "ep4_cp2": (dict(cp=2, ep=4), [(0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 0, 0, 1, 2), (0, 0, 1, 1, 3)], [2, 2, 2, 2]),
    "ep2_cp2": (dict(cp=2, ep=2), [(0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 0, 0, 1, 0), (0, 0, 1, 1, 1)], [2, 2, 1, 1]),
    "ep2_cp2_pp2": (dict(cp=2, pp=2, ep=2),
                    [(0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 1, 0, 0, 0), (0, 1, 1, 0, 1)], [3, 3, 3, 3]),
}
"""TP2 x EP2: experts split over TP inside each EP rank. EP2 x PP2: each stage's EP group is its two DP ranks (4 and
3 rows: 2 and 1 micro-batches of <= 3, both run 2). EP4 x CP2: one EP group over DP and CP, one expert a rank (2
and 1 micro-batches, both run 2). EP2 x CP2: EP groups are CP pairs (each DP rank runs its own count), the
expert-DP peers (ranks 0, 2 and 1, 3) shard the experts' Adam state (all four the dense parameters'), and EP rank
1's checkpoint file is written by a CP rank 1. EP2 x CP2 x PP2: DP 1 (7 rows, 3 micro-batches), EP groups are each stage's CP pair."""


def _ep_on_four_ranks(rank, world, path, ckpt):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.backend import MegatronBackend
    from slime_hydra.train.optim import optimizers

    out = {}
    for name, (parallel, _, _) in EP_ON_FOUR_RANKS.items():
        train = TrainConfig(**CFG, **parallel, micro_batch_samples=3)
        backend = MegatronBackend(path, train, total_steps=3)
        rows = toy_batch().select(EP2_ROWS[backend.dp_rank::backend.dp_size])
        r = out[name] = {}
        r["ranks"] = (backend.tp_rank, backend.pp_rank, backend.cp_rank, backend.dp_rank, backend.ep_rank)
        r["micro"] = len(backend._micro_batches(rows))
        r["initial"] = {n: t.clone() for n, t in backend.iter_full_weights()}
        r["logp"] = backend.logprobs(rows)[0]
        r["steps"] = _steps(backend, rows, 1)
        r["weights"] = {n: t.clone() for n, t in backend.iter_full_weights()}
        r["adam"] = [(len(getattr(part, "optim", part).state), len(part.param_groups[0]["params"]))
                     for part in optimizers(backend.optimizer)]  # [dense, experts]: (tensors with state here, all)
        background = parallel.get("cp", 1) > 1  # written by the writer's thread while the next steps train
        backend.save(ckpt / name, background=background)
        r["steps"] += _steps(backend, rows, 2)
        backend.save_finished(wait=True)
        torch.distributed.barrier()  # every rank's files are on disk
        r["files"] = sorted(f.name for f in (ckpt / name).glob("pp*.pt"))
        resumed = MegatronBackend(path, train, total_steps=3)
        resumed.load(ckpt / name)
        r["resumed"] = _steps(resumed, rows, 2)
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ep_on_four_ranks(checkpoints, tmp_path_factory):
    return run_ranks(4, _ep_on_four_ranks, checkpoints[TRAIN], tmp_path_factory.mktemp("moe_ep_four_ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("name", EP_ON_FOUR_RANKS)
def test_expert_parallelism_on_four_ranks_equals_tp1(one_rank, ep_on_four_ranks, checkpoints, name):
    """Expert parallelism with TP, PP and CP on 4 ranks, one spawn (EP_ON_FOUR_RANKS): each rank's logprobs of its
    rows equal TP1's within 1e-5; the first step's loss and grad norm within 1e-5 relative, three steps within
    1e-4; iter_full_weights gives every rank every tensor, bit for bit the checkpoint's before training, after a step
    the same on every rank and within 1e-3 of TP1's (a tenth of AdamW's first step of lr 1e-2, whose size is
    g / (|g| + eps) x lr: the few elements with |g| near eps = 1e-8 move by float noise, measured up to 1.9e-4; a
    misplaced expert would be off by ~0.2); the distributed optimizer shards the dense parameters' Adam state over
    the DP x CP peers and the experts' over the expert-DP peers; a checkpoint (one file per stage, TP rank and EP
    rank, and the dense optimizer state per stage and TP rank; with CP written in the background while the next two
    steps train) resumes those two steps exactly."""
    out, _ = one_rank
    parallel, layout, micro = EP_ON_FOUR_RANKS[name]
    dp = 4 // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    results = [ranks[name] for ranks in ep_on_four_ranks]
    original = AutoModelForCausalLM.from_pretrained(checkpoints[TRAIN], dtype=torch.float32).state_dict()
    for rank, r in enumerate(results):
        assert (r["ranks"], r["micro"]) == (layout[rank], micro[rank])
        want = out["tp1_rows7_logp"][r["ranks"][3]::dp]  # [rows of this DP rank, T of all 7 rows]
        torch.testing.assert_close(r["logp"], want[:, :r["logp"].shape[1]], atol=1e-5, rtol=0)
        assert _close(r["steps"][:1], out["tp1_rows7"][:1], 1e-5), (name, rank, r["steps"], out["tp1_rows7"])
        assert _close(r["steps"], out["tp1_rows7"], 1e-4), (name, rank, r["steps"], out["tp1_rows7"])
        assert r["resumed"] == r["steps"][1:], (name, rank, r["resumed"], r["steps"])
        assert set(r["initial"]) == set(original) == set(r["weights"])
        for n, tensor in original.items():
            assert torch.equal(r["initial"][n], tensor), (name, rank, n)
            assert torch.equal(r["weights"][n], results[0]["weights"][n]), (name, rank, n)
            torch.testing.assert_close(r["weights"][n], out["tp1_rows7_weights"][n], atol=1e-3, rtol=0)
    tp, stages, ep = parallel.get("tp", 1), parallel.get("pp", 1), parallel["ep"]
    assert results[0]["files"] == sorted([f"pp{s}_tp{t}_ep{e}.pt" for s in range(stages) for t in range(tp)
                                          for e in range(ep)] + [f"pp{s}_tp{t}_dense_optim.pt"
                                                                 for s in range(stages) for t in range(tp)])
    # ZeRO: the dense parameters' Adam state split over the DP x CP peers (the ranks of one TP rank and stage: 2 or
    # 4 here), the experts' over the expert-DP peers (those of one EP rank too: 2 at EP2 x CP2, else 1, plain
    # AdamW): each peer holds a share, the shares all the part's tensors
    peers = {0: 4 // (tp * stages), 1: 4 // (tp * stages * ep)}
    for part, group_of in ((0, lambda at: at[:2]), (1, lambda at: (at[0], at[1], at[4]))):
        groups = {}
        for rank, r in enumerate(results):
            groups.setdefault(group_of(layout[rank]), []).append(r["adam"][part])
        for members in groups.values():
            held, total = zip(*members)
            assert len(members) == peers[part] and sum(held) == total[0], (name, part, members)
            assert len(members) == 1 or 0 < max(held) < total[0], (name, part, members)


def test_load_balancing_loss_is_an_option_and_tp2_and_pp2_equal_tp1(one_rank, two_ranks):
    """train.megatron.moe_aux_loss_coeff: megatron's switch loss per MoE layer adds to the gradients, not to the
    reported policy loss; each micro-batch's weighted like its main loss, the same at TP2 and at PP2 (3 micro-batches
    of unequal weight: stage 0 runs micro-batch 0's backward after micro-batch 1's forward) as at TP1."""
    out, _ = one_rank
    (aux_loss, aux_norm), (loss, norm) = out["aux_tp1"][0], out["tp1_micro3"][0]
    assert abs(aux_loss - loss) <= 1e-6 * abs(loss) and abs(aux_norm - norm) > 1e-4 * norm
    for rank in range(2):
        for name in ("aux_tp2", "aux_pp2"):
            assert _close(two_ranks[rank][name], out["aux_tp1"], 1e-5), (name, two_ranks[rank][name], out["aux_tp1"])


def test_lora_on_the_attention_of_a_moe_model_agrees_with_fsdp_and_at_ep2(one_rank, two_ranks):
    """LoRA on q/k/v/o of the MoE model: megatron from fsdp's initial adapter (its PEFT export) takes the same three
    steps (loss, grad norm) as fsdp; EP2 from the seeded initial adapter the same two steps as TP1 on those rows."""
    out, _ = one_rank
    assert _close(out["megatron_lora"], out["fsdp_lora"], 1e-5), (out["megatron_lora"], out["fsdp_lora"])
    assert out["fsdp_lora"][-1][0] < out["fsdp_lora"][0][0]  # it trained
    for rank in range(2):
        assert _close(two_ranks[rank]["ep2_lora"], out["tp1_rows7_lora"], 1e-5), (
            two_ranks[rank]["ep2_lora"], out["tp1_rows7_lora"])


def test_ep2_checkpoint_resume_reproduces_the_next_steps_exactly(two_ranks):
    for rank in range(2):
        assert two_ranks[rank]["ep2_resumed"] == two_ranks[rank]["ep2_next"]


def test_unsupported_moe_settings_are_refused_with_the_fix(one_rank):
    out, _ = one_rank
    ep, lora = out["refused"]
    assert "train.ep=2 must divide" in ep and "data-parallel size (1" in ep
    assert "train.lora.target_modules=" in lora and "routed experts" in lora and "[q_proj,k_proj,v_proj,o_proj]" in lora


def _ep2_layer_compiled_and_eager(rank, world, path):
    """One MoE layer's output at EP2, eager and with its token dispatch compiled (train.compile compiles whole
    layers: torch.compile returned the gathered bool routing map as int64, and megatron's permutation refused it)."""
    from slime_hydra.train.megatron.model import build_model, init_parallel, transformer_config
    from slime_hydra.train.megatron.convert import load_hf_weights

    init_parallel(1, ep=2)
    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(arch, transformer_config(arch, tp=1, ep=2))
    load_hf_weights(model, path, arch)
    layer = model.decoder.layers[arch.moe_layers[0]].mlp
    hidden = torch.randn(5 + rank, 1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        eager = layer(hidden)[0]
        layer.dispatch = torch.compile(layer.dispatch)
        compiled = layer(hidden)[0]
    return eager, compiled


def test_a_compiled_ep2_dispatch_keeps_the_routing_map_boolean(checkpoints):
    for eager, compiled in run_ranks(2, _ep2_layer_compiled_and_eager, checkpoints[TRAIN]):
        assert torch.equal(eager, compiled)
