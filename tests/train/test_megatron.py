"""train=megatron on CPU with gloo: HF <-> Megatron conversion for every family (logits equal at TP1 and TP2,
and bit for bit those of megatron's own QKV split and RoPE; weights round-trip), vocab-parallel logprobs, TP2 == DP2 == PP2 == TP2xPP2 == TP1 == FSDP on the same batch, logprob
alignment and the reference policy, the embedded engine's rollout logprobs, resume exactness (in process, and
across killed processes at PP2), HF export, the PPO critic (values equal FSDP's, a step lowers the value loss),
context parallelism (CP2, TP2xCP2, CP2xPP2 == CP1: logprobs, entropy, loss, grad norm, weights after a step, critic).

Spawned processes cost ~10 s each on the 2-core machine, so a few module-scoped runs compute everything and the
tests assert on their results. Functions run on spawned ranks are module-level (pickled by name).
On a GPU machine, ``python3 -m pytest -m gpu tests/train/test_megatron.py`` checks the CUDA path against HF (fp32
logprobs; a bf16 step's loss and grad norm) and, with 2 GPUs, TP2, PP2 and CP2 against DP2 over nccl.
"""

from dataclasses import replace
from functools import partial

import asyncio

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention as MegatronSelfAttention
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.model.config import ModelConfig
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.objectives import CriticLoss
from slime_hydra.train.megatron.convert import hf_to_megatron, megatron_to_hf, param_map, shard
from slime_hydra.train.megatron.model import Arch
from slime_hydra.train.megatron.vocab_parallel import vocab_parallel_logprobs
from tests.train.harness import TINY, assert_policy_logprobs, pg_loss, run_ranks, tiny_checkpoint, toy_batch

FAMILIES = ("qwen2", "qwen3", "llama", "glm4")
CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0)
TRAIN_FAMILY = "qwen3"  # q/k norms: the one parameter whose gradient is partial on each TP rank


CRITIC = CriticLoss(AlgoConfig(), max_response_tokens=8)
"""PPO's clipped value loss (value_clip 0.2, coefficient 0.5), as the loop trains the critic."""
ROLLOUT_PROMPTS = [[7], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [60, 61, 62]]


@pytest.fixture(scope="module")
def checkpoints():
    return {family: tiny_checkpoint(family) for family in FAMILIES}


def critic_batch(values: torch.Tensor | None = None):
    """toy_batch with fixed value targets (returns) and the critic's own values as old_values."""
    batch = toy_batch()
    returns = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(3)) * batch.loss_mask
    batch.extras.update(returns=returns, old_values=values if values is not None else torch.zeros_like(returns))
    return batch


@pytest.fixture(scope="module")
def rollouts(checkpoints, tmp_path_factory):
    """Responses sampled (temperature 1) by the embedded engine from the training checkpoint, with its logprobs."""
    from slime_hydra.rollout.client import SGLangClient
    from slime_hydra.rollout.engines import start_embedded_engine

    engine = start_embedded_engine(str(checkpoints[TRAIN_FAMILY]),
                                   log_path=tmp_path_factory.mktemp("engine_log") / "engine.log")

    async def generate():
        async with SGLangClient(engine.url, timeout_s=120) as client:
            return await client.generate(ROLLOUT_PROMPTS, [{"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True,
                                                            "sampling_seed": i} for i in range(len(ROLLOUT_PROMPTS))],
                                         return_logprob=True)
    try:
        replies = asyncio.run(generate())
    finally:
        engine.stop()
    responses = [r["output_ids"] for r in replies]
    engine_logp = [[item[0] for item in r["meta_info"]["output_token_logprobs"]] for r in replies]
    batch = collate([p + r for p, r in zip(ROLLOUT_PROMPTS, responses)], [len(r) for r in responses],
                    [[1] * len(r) for r in responses], pad_id=0)
    return batch, engine_logp


# ---- ranks' work --------------------------------------------------------------------------------------------
def _logits_and_weights(path, tp):
    """Full-vocabulary logits of a fixed batch and the exported HF weights, on a freshly loaded GPTModel."""
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_hydra.train.megatron.model import build_model, transformer_config
    from slime_hydra.train.megatron.spec import SelfAttention

    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    model = build_model(arch, transformer_config(arch, tp=tp))
    load_hf_weights(model, path, arch)
    model.eval()
    ids = torch.randint(0, TINY.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        local = model(ids, torch.arange(13).expand_as(ids), None)
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        for layer in model.decoder.layers:  # megatron's own QKV split and RoPE (from freqs) on the same modules
            attention = layer.self_attention
            attention.forward = partial(MegatronSelfAttention.forward, attention)
            attention.get_query_key_value_tensors = partial(MegatronSelfAttention.get_query_key_value_tensors,
                                                            attention)
        stock = model(ids, torch.arange(13).expand_as(ids), None)
    weights = {name: t.clone() for name, t in iter_hf_weights(model, arch, group)}
    ours = all(type(layer.self_attention) is SelfAttention for layer in model.decoder.layers)
    return ids, torch.cat(parts, dim=-1), weights, ours and torch.equal(local, stock)


def _convert_every_family(rank, world, paths):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.model import init_parallel

    out = {}
    for tp in (2, 1):  # tp=1 on 2 ranks: two data-parallel replicas
        init_parallel(tp)
        out[tp] = {family: _logits_and_weights(path, tp) for family, path in paths.items()}
        parallel_state.destroy_model_parallel()
    return out


def _three_steps(backend, batch):
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(batch, pg_loss) for _ in range(3))]


def _one_rank(rank, world, path, rollout_batch, critic_dir):
    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    megatron = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
    out["megatron_hot"] = megatron.logprobs(batch, temperature=0.7, with_entropy=True)
    out["rollout_logp"] = {"megatron": megatron.logprobs(rollout_batch)[0]}  # the checkpoint's weights
    out["tp1"] = _three_steps(megatron, batch)
    split = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=3)
    out["tp1_micro3"] = _three_steps(split, batch)
    out["tp1_micro3_weights"] = {name: t.clone() for name, t in split.iter_full_weights()}
    fsdp = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=3)
    out["fsdp_hot"] = fsdp.logprobs(batch, temperature=0.7, with_entropy=True)
    out["rollout_logp"]["fsdp"] = fsdp.logprobs(rollout_batch)[0]
    out["fsdp"] = _three_steps(fsdp, batch)

    critic_cfg = TrainConfig(**CFG, critic_lr=1e-4, micro_batch_samples=3)
    fsdp_critic = FSDPBackend(path, critic_cfg, total_steps=1, role="critic")  # a fresh value head
    out["fsdp_values"] = fsdp_critic.values(batch)
    fsdp_critic.export_hf(critic_dir)  # the same weights for megatron's critic
    critic = MegatronBackend(critic_dir, critic_cfg, total_steps=2, role="critic")
    values = critic.values(batch)
    fixed = critic_batch(values)
    before = float(critic.train_step(fixed, CRITIC)["value_loss"])
    after = float(CRITIC(critic.values(fixed), None, fixed)[1]["value_loss"])
    out["critic"] = values, before, after, critic.scheduler.get_last_lr()[0]

    policy = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=2, keep_reference=True)
    current, entropy = policy.logprobs(batch, "current", with_entropy=True)
    ref0, _ = policy.logprobs(batch, "ref")
    policy.train_step(batch, pg_loss)
    after, _ = policy.logprobs(batch, "current")
    ref1, _ = policy.logprobs(batch, "ref")
    out["policy"] = current, entropy, ref0, after, ref1

    out["refused"] = []
    for bad in (dict(cp=2), dict(ep=2), dict(gradient_checkpointing=True), dict(megatron={"recompute_granularty": 1})):
        try:
            MegatronBackend(path, TrainConfig(**CFG, **bad), total_steps=1)
            out["refused"].append(None)
        except ValueError as error:
            out["refused"].append(str(error))
    return out


def _two_ranks(rank, world, path, ckpt, export):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.backend import MegatronBackend

    out = {}
    tp2 = MegatronBackend(path, TrainConfig(**CFG, tp=2, micro_batch_samples=8), total_steps=3)
    assert (tp2.dp_rank, tp2.dp_size) == (0, 1)
    out["tp2"] = _three_steps(tp2, toy_batch())

    train = TrainConfig(**CFG, tp=2, micro_batch_samples=2)
    full = MegatronBackend(path, train, total_steps=6, keep_reference=True)
    batch = toy_batch()
    losses = [float(full.train_step(batch, pg_loss)["pg_loss"]) for _ in range(2)]
    full.save(ckpt)
    losses += [float(full.train_step(batch, pg_loss)["pg_loss"]) for _ in range(2)]
    resumed = MegatronBackend(path, train, total_steps=6, keep_reference=True)
    resumed.load(ckpt)
    out["resume"] = losses, [float(resumed.train_step(batch, pg_loss)["pg_loss"]) for _ in range(2)], resumed.step
    out["resume_ref"] = full.logprobs(batch, "ref")[0], resumed.logprobs(batch, "ref")[0]

    out["weights"] = {name: t.clone() for name, t in full.iter_full_weights()}
    full.export_hf(export)
    out["logp"] = full.logprobs(batch)[0]
    out["replicated"] = {n: p.detach().clone() for n, p in full.model.named_parameters() if n not in full._tp_split}

    parallel_state.destroy_model_parallel()
    dp2 = MegatronBackend(path, TrainConfig(**CFG, tp=1, micro_batch_samples=2), total_steps=3)
    out["dp"] = (dp2.dp_rank, dp2.dp_size)
    rows = toy_batch().select(list(range(dp2.dp_rank, 8, dp2.dp_size)))
    out["dp2"] = _three_steps(dp2, rows)
    # train.distributed_optimizer (default): ZeRO-1 over the two DP peers; without it, the same three steps
    plain = MegatronBackend(path, TrainConfig(**CFG, tp=1, micro_batch_samples=2, distributed_optimizer=False),
                            total_steps=3)
    out["dp2_plain"] = _three_steps(plain, rows)
    out["zero"] = (dp2.zero, plain.zero, len(dp2.optimizer.optim.state), len(plain.optimizer.state),
                   max(float((a - b).abs().max()) for a, b in zip(dp2.model.parameters(), plain.model.parameters())))
    return out


@pytest.fixture(scope="module")
def converted(checkpoints):
    return run_ranks(2, _convert_every_family, checkpoints)


def _pipeline(rank, world, path, critic_dir, ckpt, export):
    """PP2 on 2 ranks: the same calls as the PP1 run, a checkpoint after the first step, the critic."""
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    policy = MegatronBackend(path, TrainConfig(**CFG, pp=2, micro_batch_samples=3), total_steps=3, keep_reference=True)
    out["stage"] = (policy.pp_rank, policy.first_stage, policy.last_stage)
    out["hot"] = policy.logprobs(batch, temperature=0.7, with_entropy=True)
    out["steps"] = _three_steps_saving(policy, batch, ckpt)
    out["weights"] = {name: t.clone() for name, t in policy.iter_full_weights()}
    out["logp"] = policy.logprobs(batch)[0]
    policy.export_hf(export)
    critic = MegatronBackend(critic_dir, TrainConfig(**CFG, pp=2, critic_lr=1e-4, micro_batch_samples=3),
                             total_steps=2, role="critic")
    values = critic.values(batch)
    fixed = critic_batch(values)
    before = float(critic.train_step(fixed, CRITIC)["value_loss"])
    out["critic"] = values, before, float(CRITIC(critic.values(fixed), None, fixed)[1]["value_loss"])
    return out


def _three_steps_saving(backend, batch, ckpt):
    """_three_steps with a checkpoint after the first."""
    steps = []
    for k in range(3):
        metrics = backend.train_step(batch, pg_loss)
        steps.append((float(metrics["pg_loss"]), metrics["grad_norm"]))
        if k == 0:
            backend.save(ckpt)
    return steps


def _pipeline_resumed(rank, world, path, ckpt):
    """Fresh processes (the saving ones are gone): load the PP2 checkpoint and take the next two steps."""
    from slime_hydra.train.megatron.backend import MegatronBackend

    policy = MegatronBackend(path, TrainConfig(**CFG, pp=2, micro_batch_samples=3), total_steps=3, keep_reference=True)
    policy.load(ckpt)
    steps = [(float(m["pg_loss"]), m["grad_norm"]) for m in (policy.train_step(toy_batch(), pg_loss)
                                                             for _ in range(2))]
    return steps, policy.step


def _tp2_pp2(rank, world, path):
    from slime_hydra.train.megatron.backend import MegatronBackend

    backend = MegatronBackend(path, TrainConfig(**CFG, tp=2, pp=2, micro_batch_samples=3), total_steps=3)
    batch = toy_batch()
    hot = backend.logprobs(batch, temperature=0.7, with_entropy=True)
    return (backend.tp_rank, backend.pp_rank), hot, _three_steps(backend, batch)[:1]


CP_CFG = dict(CFG, adam_eps=1e-3)
"""CFG with a large Adam epsilon where parameters after a step are compared. Adam's first step is
lr * g / (|g| + eps): at eps 1e-8 a gradient of 1e-9 (next to ones of 1e-2) moves its parameter by ~lr / 10, so the
fp32 rounding of a different summation order (CP sums over ranks) changes updates by up to ~2e-4 at lr 1e-2; at
eps 1e-3 the step is Lipschitz in g (lr / eps), and the parameters compare as tightly as the gradients."""


def pg_entropy_loss(logp, entropy, mb):
    """pg_loss with an entropy bonus (0.1 x token-mean entropy): gradients flow through the entropy too."""
    loss, metrics = pg_loss(logp, entropy, mb)
    m = mb.loss_mask
    return loss - 0.1 * (entropy * m).sum() / m.sum().clamp(min=1), metrics


def _context_parallel(rank, world, path, cp, tp=1, pp=1, critic=True, ckpt=None):
    """cp x tp x pp ranks (all 1: the reference) on toy_batch: logprobs and entropy at temperature 0.7 (one
    micro-batch, 10 tokens: padded to 12 at cp=2), one step with an entropy bonus over micro-batches of 9, 10 and 8
    tokens (full weights after it), the critic's values and one value step. ``ckpt``: save after the step, take a
    second one, then load the checkpoint at cp=1 (dp=2 on the same ranks) and take the second step again."""
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    train = TrainConfig(**CP_CFG, cp=cp, tp=tp, pp=pp, micro_batch_samples=3)
    policy = MegatronBackend(path, train, total_steps=2)
    out["ranks"] = policy.pp_rank, policy.cp_rank, policy.tp_rank, policy.dp_size
    out["hot"] = policy.logprobs(batch, temperature=0.7, with_entropy=True)
    metrics = policy.train_step(batch, pg_entropy_loss, with_entropy=True)
    out["step"] = float(metrics["pg_loss"]), metrics["grad_norm"]
    out["weights"] = {name: t.clone() for name, t in policy.iter_full_weights()}
    if critic:
        critic = MegatronBackend(path, replace(train, critic_lr=1e-3), total_steps=1, role="critic")  # fresh head
        values = critic.values(batch)
        fixed = critic_batch(values)
        metrics = critic.train_step(fixed, CRITIC)
        out["critic"] = values, (float(metrics["value_loss"]), metrics["grad_norm"]), critic.values(fixed)
    if ckpt is not None:
        policy.save(ckpt)
        second = policy.train_step(batch, pg_loss)
        parallel_state.destroy_model_parallel()
        dp2 = MegatronBackend(path, replace(train, cp=1), total_steps=2)
        dp2.load(ckpt)
        resumed = dp2.train_step(batch.select(list(range(dp2.dp_rank, 8, dp2.dp_size))), pg_loss)
        out["resume"] = [(float(m["pg_loss"]), m["grad_norm"]) for m in (second, resumed)]
    return out


@pytest.fixture(scope="module")
def context_parallel(checkpoints, tmp_path_factory):
    """(the cp=1 reference on one rank, the CP2 run on two ranks with its checkpoint resumed at DP2)."""
    path = checkpoints[TRAIN_FAMILY]
    reference = run_ranks(1, _context_parallel, path, 1)[0]
    return reference, run_ranks(2, _context_parallel, path, 2, 1, 1, True, tmp_path_factory.mktemp("cp") / "ckpt")


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("critic")


@pytest.fixture(scope="module")
def one_rank(checkpoints, rollouts, critic_dir):
    return run_ranks(1, _one_rank, checkpoints[TRAIN_FAMILY], rollouts[0], critic_dir)[0]


@pytest.fixture(scope="module")
def pipeline(checkpoints, one_rank, critic_dir, tmp_path_factory):
    """(PP2 results per rank, the resumed run's per rank, the export dir); one_rank wrote the critic checkpoint."""
    tmp = tmp_path_factory.mktemp("pipeline")
    path = checkpoints[TRAIN_FAMILY]
    saved = run_ranks(2, _pipeline, path, critic_dir, tmp / "ckpt", tmp / "hf")
    return saved, run_ranks(2, _pipeline_resumed, path, tmp / "ckpt"), tmp / "hf"


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    return run_ranks(2, _two_ranks, checkpoints[TRAIN_FAMILY], tmp / "ckpt", tmp / "hf"), tmp / "hf"


# ---- conversion -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_hf_logits(converted, checkpoints, family, tp):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32)
    for rank in range(2):
        ids, logits, _, same_as_stock_attention = converted[rank][tp][family]
        with torch.no_grad():
            expected = hf(ids).logits
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert same_as_stock_attention  # spec.SelfAttention's split and RoPE == megatron's, bit for bit


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_round_trip_hf_megatron_hf(converted, checkpoints, family, tp):
    original = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).state_dict()
    for rank in range(2):
        weights = converted[rank][tp][family][2]
        assert set(weights) == set(original)
        for name, tensor in original.items():
            assert torch.equal(weights[name], tensor), (family, tp, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_shards_and_unshards_for_any_tp(checkpoints, family):
    path = checkpoints[family]
    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    assert arch == Arch.from_model_config(ModelConfig(**{**TINY.__dict__, "family": family}))
    hf = load_file(path / "model.safetensors")
    if arch.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    for tp in (1, 2, 4):  # tp=4 > num_kv_heads=2: groups split across ranks
        per_rank = [hf_to_megatron(hf, arch, r, tp) for r in range(tp)]
        assert all(per_rank[r][n].shape == per_rank[0][n].shape for r in range(tp) for n in per_rank[0])
        back = megatron_to_hf(per_rank, arch)
        assert set(back) == set(hf)
        assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_qkv_rows_interleave_per_query_group_and_gate_up_halves_per_rank():
    arch = replace(Arch.from_model_config(TINY), head_dim=1)
    qkv = next(p for p in param_map(arch) if p.kind == "qkv")
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # 4 heads of width 1; 2 kv groups -> 2 q heads per group
    k, v = torch.tensor([[20.0], [21.0]]), torch.tensor([[30.0], [31.0]])
    assert shard(qkv, [q, k, v], arch, 0, 2).flatten().tolist() == [10, 11, 20, 30]  # group 0: q0 q1 k0 v0
    assert shard(qkv, [q, k, v], arch, 1, 2).flatten().tolist() == [12, 13, 21, 31]
    fc1 = next(p for p in param_map(arch) if p.kind == "gate_up")
    gate, up = torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 14.0).unsqueeze(1)
    assert shard(fc1, [gate, up], arch, 1, 2).flatten().tolist() == [2, 3, 12, 13]  # [gate rows; up rows] of rank 1


def test_families_megatron_cannot_express_are_refused():
    from slime_hydra.model.hf import hf_config

    for family, overrides, words in (("qwen3", dict(attention_bias=True), "o_proj"),
                                     ("llama", dict(mlp_bias=True), "mlp_bias"),
                                     ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 1e4}), "attention scaling")):
        with pytest.raises(ValueError, match=words):
            Arch.from_hf(hf_config(ModelConfig(**{**TINY.__dict__, "family": family}), **overrides))


def test_vocab_parallel_logprobs_and_entropy_match_log_softmax():
    logits = torch.randn(5, 7, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (5, 7))
    logp, entropy = vocab_parallel_logprobs(logits, targets, 0, None, with_entropy=True)
    log_probs = torch.log_softmax(logits, -1)
    expected_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(logp, expected_logp)
    torch.testing.assert_close(entropy, expected_entropy)
    weights = torch.randn(2, 5, 7, dtype=torch.float64)
    got = torch.autograd.grad((weights[0] * logp + weights[1] * entropy).sum(), logits)[0]
    want = torch.autograd.grad((weights[0] * expected_logp + weights[1] * expected_entropy).sum(), logits)[0]
    torch.testing.assert_close(got, want)


# ---- the backend ------------------------------------------------------------------------------------------
def _close(got, want, rel):
    """[(loss, grad_norm)] per step, each within rel (relative) of the reference."""
    return len(got) == len(want) and all(abs(a - b) <= rel * abs(b) for g, w in zip(got, want) for a, b in zip(g, w))


def test_tp2_dp2_and_micro_batches_equal_tp1_on_the_same_batch(one_rank, two_ranks):
    two_ranks, _ = two_ranks
    tp1 = one_rank["tp1"]
    for name, got in (("tp2", two_ranks[0]["tp2"]), ("dp2", two_ranks[0]["dp2"]), ("micro3", one_rank["tp1_micro3"])):
        assert _close(got[:1], tp1[:1], 1e-5), (name, got, tp1)  # the same weights and batch: fp32 rounding only
        assert _close(got, tp1, 1e-4), (name, got, tp1)  # two more Adam steps on top
    assert two_ranks[0]["tp2"] == two_ranks[1]["tp2"]  # TP peers report the same loss and norm
    assert two_ranks[0]["dp"] == (0, 2) and two_ranks[1]["dp"] == (1, 2)
    assert tp1[2][0] < tp1[0][0]  # the policy-gradient loss falls


def test_distributed_optimizer_shards_adam_state_and_takes_the_same_steps(two_ranks):
    two_ranks, _ = two_ranks
    owned = []
    for rank in range(2):
        zero, plain_zero, own, full, weight_diff = two_ranks[rank]["zero"]
        assert zero and not plain_zero
        assert two_ranks[rank]["dp2"] == two_ranks[rank]["dp2_plain"]  # the same losses and grad norms, bitwise
        assert weight_diff < 1e-6  # foreach (ZeRO) vs fused-or-foreach AdamW: the same update up to rounding
        assert 0 < own < full
        owned.append(own)
    assert sum(owned) == full  # every parameter's Adam state lives on exactly one peer


def test_megatron_and_fsdp_agree(one_rank):
    assert _close(one_rank["tp1"], one_rank["fsdp"], 1e-2)
    assert _close(one_rank["tp1"][:1], one_rank["fsdp"][:1], 1e-5)
    (m_logp, m_ent), (f_logp, f_ent) = one_rank["megatron_hot"], one_rank["fsdp_hot"]  # temperature 0.7
    torch.testing.assert_close(m_logp, f_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(m_ent, f_ent, atol=1e-5, rtol=0)


def test_logprobs_align_with_a_plain_forward_and_reference_is_the_initial_policy(one_rank, checkpoints):
    assert_policy_logprobs(checkpoints[TRAIN_FAMILY], *one_rank["policy"])


def test_checkpoint_resume_reproduces_the_next_steps_exactly(two_ranks):
    two_ranks, _ = two_ranks
    for rank in range(2):
        losses, resumed, step = two_ranks[rank]["resume"]
        assert resumed == losses[2:]  # bitwise equal losses after resume
        assert step == 4
        ref_full, ref_resumed = two_ranks[rank]["resume_ref"]
        assert torch.equal(ref_full, ref_resumed)


def test_export_hf_and_full_weights_match_the_trained_model(two_ranks, checkpoints):
    two_ranks, export = two_ranks
    weights, logp = two_ranks[0]["weights"], two_ranks[0]["logp"]
    for name, tensor in two_ranks[0]["replicated"].items():  # norms stay identical on the TP peers
        assert torch.equal(tensor, two_ranks[1]["replicated"][name]), name
    assert two_ranks[0]["replicated"], "expected replicated norm parameters"
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    state = exported.state_dict()
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(checkpoints[TRAIN_FAMILY], dtype=torch.float32).state_dict()
    assert any(not torch.equal(original[n], weights[n]) for n in weights)  # trained, not the initial weights
    batch = toy_batch()  # the exported model reproduces the trained policy's logprobs
    for i in range(batch.size):
        n, p = int(batch.attention_mask[i].sum()), int(batch.response_start[i])
        ids = batch.input_ids[i, :n].unsqueeze(0)
        with torch.no_grad():
            logp_all = torch.log_softmax(exported(ids).logits[0], -1)
        expected = torch.stack([logp_all[p + j - 1, ids[0, p + j]] for j in range(n - p)])
        torch.testing.assert_close(logp[i, : n - p], expected, atol=1e-5, rtol=0)


def test_unsupported_settings_are_refused_with_the_fix(one_rank):
    cp, ep, recompute, passthrough = one_rank["refused"]
    assert "not a multiple of train.tp=1 x train.cp=2" in cp  # one rank cannot hold two CP ranks
    assert "train.ep=2" in ep
    assert "gradient_checkpointing=false" in recompute
    assert "recompute_granularty" in passthrough


def test_context_parallelism_validates_for_megatron_and_is_refused_for_fsdp():
    from tests.config.helpers import load, problems

    big = ("model=qwen3_8b", "model.path=/ckpt/qwen3_8b", "cluster=slurm", "cluster.gpus_per_node=8",
           "train.micro_batch_samples=1")  # capacities unknown: no memory plan check (tests/config/test_memory.py)
    _, derived = load(*big, "train=megatron", "train.num_gpus=6", "train.cp=3")
    assert derived.dp == 2  # world = tp x cp x pp x dp
    _, derived = load(*big, "train=megatron", "train.num_gpus=4", "train.tp=2", "train.cp=2")
    assert derived.dp == 1
    error = problems(*big, "train.num_gpus=2", "train.cp=2")
    (problem,) = [p for p in error.problems if "train.cp" in p.keys]
    assert "train=fsdp does not split a model replica by cp=2" in problem.message
    assert problem.fix == "use train=megatron, or set train.cp=1"


# ---- the correctness gate: trainer == engine ----------------------------------------------------------------
def test_trainer_logprobs_equal_the_embedded_engines_rollout_logprobs(one_rank, rollouts):
    """fp32 on CPU, the same weights: mean |trainer - engine| < 1e-4 over the sampled response tokens."""
    batch, engine_logp = rollouts
    flat_engine = torch.tensor([x for row in engine_logp for x in row], dtype=torch.float64)
    assert flat_engine.numel() == 6 * len(ROLLOUT_PROMPTS) and (flat_engine < 0).all()
    for backend, logp in one_rank["rollout_logp"].items():
        flat = torch.cat([logp[i, : len(row)] for i, row in enumerate(engine_logp)]).double()
        assert (flat - flat_engine).abs().mean() < 1e-4, (backend, (flat - flat_engine).abs().max())


# ---- pipeline parallelism -----------------------------------------------------------------------------------
def test_pp2_logprobs_and_steps_equal_pp1(one_rank, pipeline):
    """Same weights, batch and micro-batches (3, 3, 2 rows: the 1F1B schedule interleaves them): logprobs and
    entropy within 1e-5, the first step's loss and grad norm within 1e-5 relative; two more Adam steps within 1e-4."""
    saved, _, _ = pipeline
    assert [r["stage"] for r in saved] == [(0, True, False), (1, False, True)]
    pp1_logp, pp1_entropy = one_rank["megatron_hot"]
    for rank in range(2):
        logp, entropy = saved[rank]["hot"]  # broadcast from the last stage: every rank holds them
        torch.testing.assert_close(logp, pp1_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, pp1_entropy, atol=1e-5, rtol=0)
        assert _close(saved[rank]["steps"][:1], one_rank["tp1_micro3"][:1], 1e-5), saved[rank]["steps"]
        assert _close(saved[rank]["steps"], one_rank["tp1_micro3"], 1e-4), saved[rank]["steps"]


def test_pp2_full_weights_are_complete_on_every_rank_and_equal_pp1(one_rank, pipeline):
    saved, _, export = pipeline
    pp1 = one_rank["tp1_micro3_weights"]  # after the same three steps at PP1
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    for rank in range(2):
        weights = saved[rank]["weights"]
        assert set(weights) == set(pp1) == set(exported)
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, pp1[name], atol=1e-5, rtol=0)
            assert torch.equal(exported[name], saved[0]["weights"][name]), name
    assert torch.equal(saved[0]["weights"]["lm_head.weight"], saved[0]["weights"]["model.embed_tokens.weight"])


def test_pp2_checkpoint_resume_in_fresh_processes_reproduces_the_next_steps_exactly(pipeline):
    saved, resumed, _ = pipeline
    for rank in range(2):
        steps, step = resumed[rank]
        assert steps == saved[rank]["steps"][1:]  # bitwise equal loss and grad norm
        assert step == 3


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks_equals_tp1(one_rank, checkpoints):
    results = run_ranks(4, _tp2_pp2, checkpoints[TRAIN_FAMILY])
    assert sorted(r[0] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    pp1_logp, pp1_entropy = one_rank["megatron_hot"]
    for _, (logp, entropy), steps in results:
        torch.testing.assert_close(logp, pp1_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, pp1_entropy, atol=1e-5, rtol=0)
        assert _close(steps, one_rank["tp1_micro3"][:1], 1e-5), steps


# ---- context parallelism ------------------------------------------------------------------------------------
def test_cp_split_is_megatrons_load_balanced_layout_padded_to_2cp():
    from slime_hydra.train.megatron.context_parallel import local_positions, padded_length, split_sequence

    assert [padded_length(n, 2) for n in (8, 9, 10, 12)] == [8, 12, 12, 12]
    assert padded_length(7, 3) == 12  # 2 * cp = 6 chunks
    assert local_positions(12, 0, 2).tolist() == [0, 1, 2, 9, 10, 11]  # chunks 0 and 3
    assert local_positions(12, 1, 2).tolist() == [3, 4, 5, 6, 7, 8]  # chunks 1 and 2
    held = torch.cat([local_positions(12, r, 3) for r in range(3)])
    assert sorted(held.tolist()) == list(range(12))
    x = torch.arange(24).view(2, 12)
    assert torch.equal(split_sequence(x, 1, 1, 3), x[:, [2, 3, 8, 9]])
    # the test batch's micro-batches: 9 and 10 tokens are padded (to 12), 8 is not
    assert [toy_batch().select(g).input_ids.shape[1] for g in ([0, 1, 2], [3, 4, 5], [6, 7])] == [9, 10, 8]


def _assert_cp_equals_reference(got, reference):
    """logprobs and entropy within 1e-5; loss and grad norm within 1e-5 relative; weights after the step within
    1e-6 (CP_CFG)."""
    for want, have in zip(reference["hot"], got["hot"]):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    assert _close([got["step"]], [reference["step"]], 1e-5), (got["step"], reference["step"])
    assert set(got["weights"]) == set(reference["weights"])
    for name, tensor in got["weights"].items():
        torch.testing.assert_close(tensor, reference["weights"][name], atol=1e-6, rtol=0)


def test_cp2_logprobs_loss_grad_norm_and_step_equal_cp1(context_parallel, checkpoints):
    reference, cp2 = context_parallel
    assert [r["ranks"] for r in cp2] == [(0, 0, 0, 1), (0, 1, 0, 1)]  # CP peers: one DP rank, the same rows
    for got in cp2:
        _assert_cp_equals_reference(got, reference)
    assert cp2[0]["step"] == cp2[1]["step"]  # both CP ranks report the same loss and grad norm
    initial = AutoModelForCausalLM.from_pretrained(checkpoints[TRAIN_FAMILY], dtype=torch.float32).state_dict()
    moved = max(float((initial[n] - w).abs().max()) for n, w in cp2[0]["weights"].items())
    assert moved > 1e-3  # the step changed the weights, so equal weights mean equal steps


def test_cp2_critic_values_and_step_equal_cp1(context_parallel):
    reference, cp2 = context_parallel
    values, step, after = reference["critic"]
    assert values.abs().max() > 1e-3
    for got in cp2:
        got_values, got_step, got_after = got["critic"]
        torch.testing.assert_close(got_values, values, atol=1e-5, rtol=0)
        assert _close([got_step], [step], 1e-5), (got_step, step)
        torch.testing.assert_close(got_after, after, atol=1e-5, rtol=0)


def test_cp2_checkpoint_is_per_pp_stage_and_tp_rank_and_resumes_at_dp2(context_parallel):
    _, cp2 = context_parallel
    for got in cp2:
        second, resumed = got["resume"]
        assert _close([resumed], [second], 1e-5), (resumed, second)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ranks", [
    (2, 1, [(0, 0, 0, 1), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 1, 1)]),  # TP fastest, then CP: tp_rank + 2 * cp_rank
    (1, 2, [(0, 0, 0, 1), (0, 1, 0, 1), (1, 0, 0, 1), (1, 1, 0, 1)]),  # CP before PP: cp_rank + 2 * pp_rank
], ids=["tp2_cp2", "cp2_pp2"])
def test_cp2_with_tp2_or_pp2_on_four_ranks_equals_cp1(context_parallel, checkpoints, tp, pp, ranks):
    """megatron's rank order, and CP1's results. At PP2 the activations of this rank's chunks go between the stages
    and the last stage gathers the logprobs over CP."""
    reference, _ = context_parallel
    results = run_ranks(4, _context_parallel, checkpoints[TRAIN_FAMILY], 2, tp, pp, False)
    assert [r["ranks"] for r in results] == ranks
    for got in results:
        _assert_cp_equals_reference(got, reference)


# ---- the PPO critic -----------------------------------------------------------------------------------------
def test_critic_values_equal_fsdp_critic_and_a_step_lowers_the_value_loss(one_rank, pipeline):
    values, before, after, lr = one_rank["critic"]
    torch.testing.assert_close(values, one_rank["fsdp_values"], atol=1e-5, rtol=0)  # the same exported weights
    assert values.abs().max() > 1e-3  # a real head, not zeros
    assert lr == 1e-4  # train.critic_lr, not train.lr
    assert after < before, (before, after)
    saved, _, _ = pipeline
    for rank in range(2):  # PP2 critic: the same values and the same step
        pp_values, pp_before, pp_after = saved[rank]["critic"]
        torch.testing.assert_close(pp_values, values, atol=1e-5, rtol=0)
        assert abs(pp_before - before) <= 1e-5 * abs(before) and abs(pp_after - after) <= 1e-5 * abs(after)


# ---- GPU (python3 -m pytest -m gpu tests/train/test_megatron.py on the GPU machine) -------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_one_rank(rank, world, path):
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch = toy_batch()
    fp32 = MegatronBackend(path, TrainConfig(**CFG, micro_batch_samples=8), total_steps=1)
    logp, entropy = fp32.logprobs(batch, with_entropy=True)
    bf16 = MegatronBackend(path, TrainConfig(**{**CFG, "dtype": "bf16"}, micro_batch_samples=4), total_steps=1)
    metrics = bf16.train_step(batch, pg_loss)
    return logp, entropy, (float(metrics["pg_loss"]), metrics["grad_norm"]), fp32.model.config.transformer_impl


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_logprobs_and_bf16_step_match_hf(checkpoints, family):
    """fp32 logprobs and entropy equal HF's; a bf16 (autocast) step's loss and grad norm within 2% of HF's."""
    from slime_hydra.train.batch import response_logprobs

    logp, entropy, (loss, grad_norm), impl = run_ranks(1, _gpu_one_rank, checkpoints[family])[0]
    batch = toy_batch()
    model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).cuda()
    with torch.no_grad():
        hf = model(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits
        want_logp, want_entropy = response_logprobs(hf, batch.to("cuda"), with_entropy=True)
    torch.testing.assert_close(logp, want_logp.cpu(), atol=1e-4, rtol=0)
    torch.testing.assert_close(entropy, want_entropy.cpu(), atol=1e-4, rtol=0)
    total, want_loss = float(batch.loss_mask.sum()), 0.0
    for idx in ([0, 1, 2, 3], [4, 5, 6, 7]):  # the backend's micro-batches, the same units weighting
        mb = batch.select(idx).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        weighted = pg_loss(response_logprobs(out, mb)[0], None, mb)[0] * float(mb.loss_mask.sum()) / total
        weighted.backward()
        want_loss += float(weighted)
    want_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    assert abs(loss - want_loss) <= 0.02 * abs(want_loss), (loss, want_loss)
    assert abs(grad_norm - want_norm) <= 0.02 * want_norm, (grad_norm, want_norm)
    assert impl in ("local", "transformer_engine")


def _gpu_tp(rank, world, path, tp, pp=1, cp=1):
    from slime_hydra.train.megatron.backend import MegatronBackend

    backend = MegatronBackend(path, TrainConfig(**CFG, tp=tp, pp=pp, cp=cp, micro_batch_samples=2), total_steps=3)
    return _three_steps(backend, toy_batch().select(list(range(backend.dp_rank, 8, backend.dp_size))))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_pp2_and_cp2_equal_dp2(checkpoints):
    """cp2 on CUDA also takes megatron's own RoPE slicing (get_pos_emb_on_this_cp_rank) and nccl's reduce-scatter."""
    dp2 = run_ranks(2, _gpu_tp, checkpoints[TRAIN_FAMILY], 1)[0]
    for name, tp, pp, cp in (("tp2", 2, 1, 1), ("pp2", 1, 2, 1), ("cp2", 1, 1, 2)):
        got = run_ranks(2, _gpu_tp, checkpoints[TRAIN_FAMILY], tp, pp, cp)[0]
        assert _close(got[:1], dp2[:1], 1e-4), (name, got, dp2)
        assert _close(got, dp2, 1e-3), (name, got, dp2)


def _speed_paths(rank, world, path, compiled, bf16, tp=1, pp=1):
    """Three steps and the logprobs of one tiny model, optionally compiled and/or on the bf16 compute copy; with
    the parameter dtypes and torch.compile's graph breaks ({reason: count})."""
    from torch._dynamo.utils import counters

    import slime_hydra.train.megatron.backend as module

    if bf16:  # CPU runs in fp32; take the GPU's bf16 path (ComputeCopy instead of autocast) here
        module.compute_dtype = lambda train, device: torch.bfloat16
    backend = module.MegatronBackend(path, TrainConfig(**CFG, tp=tp, pp=pp, micro_batch_samples=3, compile=compiled),
                                     total_steps=3)
    batch = toy_batch()
    logp, entropy = backend.logprobs(batch, with_entropy=True)
    steps = _three_steps(backend, batch)
    dtypes = {p.dtype for p in backend.model.parameters()}
    return steps, logp, entropy, dtypes, dict(counters["graph_break"])


def test_compiled_layers_and_head_give_the_eager_loss_grad_norm_and_logprobs(checkpoints):
    path = checkpoints[TRAIN_FAMILY]
    eager_steps, eager_logp, eager_entropy, _, _ = run_ranks(1, _speed_paths, path, False, False)[0]
    steps, logp, entropy, _, breaks = run_ranks(1, _speed_paths, path, True, False)[0]  # CPU inductor compiles
    assert breaks == {}  # each compiled layer (and the head) is one graph
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, eager_steps):  # fp32, fused kernels' summation order
        assert abs(loss - ref_loss) < 1e-4 * max(1, abs(ref_loss)) and abs(norm - ref_norm) < 1e-4 * max(1, ref_norm)
    torch.testing.assert_close(logp, eager_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, eager_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_bf16_compute_copy_keeps_fp32_masters_and_tracks_fp32(checkpoints, tp, pp):
    """The GPU's bf16 path (bf16 copies of each rank's shards, fp32 gradient accumulation into the masters):
    loss and grad norm within bf16 tolerance of fp32, at TP1, TP2 and PP2; the parameters stay fp32."""
    path = checkpoints[TRAIN_FAMILY]
    ref_steps, ref_logp, _, _, _ = run_ranks(1, _speed_paths, path, False, False)[0]
    for steps, logp, _, dtypes, _ in run_ranks(tp * pp, _speed_paths, path, False, True, tp, pp):
        assert dtypes == {torch.float32}
        for (loss, norm), (ref_loss, ref_norm) in zip(steps[:1], ref_steps[:1]):
            assert abs(loss - ref_loss) < 0.02 * max(1, abs(ref_loss)) and abs(norm - ref_norm) < 0.02 * ref_norm
        assert (logp - ref_logp).abs().max() < 0.05
        assert steps[2][0] < steps[0][0]
