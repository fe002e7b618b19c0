"""Routing replay in the trainer (algo.routing_replay): a batch's ``routed_experts`` decide every MoE layer's experts.

On a tiny Qwen3-MoE (3 layers, the middle one dense; 4 experts, top-2; fp32 on CPU), and for the sigmoid router's
weights a tiny GLM-4.5 (grouped router, routed scaling, a shared expert; tests/train/test_megatron_moe_families.py):
- replaying the model's own routing changes nothing (bit for bit on both backends);
- packed rows (train.pack_sequences) replay it as padded ones do, on both backends;
- an arbitrary routing (random experts per token and layer, some positions left to the router) moves the logprobs,
  and train=fsdp (transformers' routers, train/routing_replay.py) and train=megatron (megatron's top-k with
  moe.ReplayedChoice) agree on its logprobs and on three training steps (loss, grad norm), on GLM-4.5 on its
  logprobs, and megatron at EP2 and CP2 equals its TP1;
- end to end with the engine: on a model whose router logits lie close together, an engine whose router weights
  differ from the trainer's by 1e-3 routes some tokens elsewhere; it reports its experts, and replaying them brings
  the trainer's logprobs from the flipped tokens' gap down to the tiny difference the router weights still make.

Spawned gloo ranks compute everything (module-scoped); the tests assert on their results.
"""

import asyncio
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_hydra import routed_experts
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.routing_replay import moe_routers
from tests.rollout.test_routed_experts import LAYERS, TOP_K, moe_checkpoint
from tests.train.harness import pg_loss, run_ranks, toy_batch
from tests.train.test_megatron_moe_families import family_checkpoint

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0, micro_batch_samples=4)
SPARSE = (0, 2)
"""The MoE layers (layer 1 is dense)."""


def forced_routing(batch, seed: int = 0, layers: int = LAYERS, top_k: int = TOP_K, num_experts: int = 4,
                   sparse=SPARSE) -> torch.Tensor:
    """[B, L, layers, top_k]: top_k distinct random experts of num_experts per position and MoE layer; -1 on the
    dense layers and on row 0's last three positions (those the router chooses itself)."""
    g = torch.Generator().manual_seed(seed)
    b, length = batch.input_ids.shape
    experts = torch.full((b, length, layers, top_k), routed_experts.NO_EXPERT, dtype=torch.int16)
    for layer in sparse:
        experts[:, :, layer] = torch.rand(b, length, num_experts, generator=g).argsort(-1)[..., :top_k].to(torch.int16)
    n = int(batch.attention_mask[0].sum())
    experts[0, n - 3:n] = routed_experts.NO_EXPERT
    return experts


def own_routing(model, batch) -> torch.Tensor:
    """[B, L, LAYERS, TOP_K] the experts a plain forward of the padded batch chooses."""
    b, length = batch.input_ids.shape
    out = torch.full((b * length, LAYERS, TOP_K), routed_experts.NO_EXPERT, dtype=torch.int16)
    def keep(layer, module, args, output):
        out[:, layer] = output[2]

    hooks = [router.register_forward_hook(partial(keep, i)) for i, router in moe_routers(model.model.layers).items()]
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for h in hooks:
        h.remove()
    return out.view(b, length, LAYERS, TOP_K)


def with_routing(batch, experts):
    batch.routed_experts = experts
    return batch


def _steps(backend, batch, n=3):
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(batch, pg_loss) for _ in range(n))]


def _one_rank(rank, world, path, engine_batch, near_ties, glm):
    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    own = with_routing(toy_batch(), own_routing(AutoModelForCausalLM.from_pretrained(path), batch))
    forced = with_routing(toy_batch(), forced_routing(batch))
    for name, cls in (("fsdp", FSDPBackend), ("megatron", MegatronBackend)):
        backend = cls(path, TrainConfig(**CFG), total_steps=3)
        out[name] = {"plain": backend.logprobs(batch)[0], "own": backend.logprobs(own)[0],
                     "forced": backend.logprobs(forced)[0], "steps": _steps(backend, forced)}
        packed = cls(path, TrainConfig(**CFG, pack_sequences=True), total_steps=3)
        out[name]["packed"] = {"forced": packed.logprobs(forced)[0], "steps": _steps(packed, forced)}
    glm_forced = with_routing(toy_batch(), forced_routing(batch, layers=3, top_k=4, num_experts=8, sparse=(1, 2)))
    for name, cls in (("fsdp", FSDPBackend), ("megatron", MegatronBackend)):  # layer 0 dense; 8 experts, top-4
        backend = cls(glm, TrainConfig(**CFG), total_steps=1)
        out[name]["glm"] = {"plain": backend.logprobs(batch)[0], "forced": backend.logprobs(glm_forced)[0]}
    fsdp = FSDPBackend(near_ties, TrainConfig(**CFG), total_steps=1)
    out["engine"] = {"plain": fsdp.logprobs(with_routing(engine_batch, None))[0],
                     "replayed": fsdp.logprobs(with_routing(engine_batch, engine_batch.extras.pop("experts")))[0]}
    return out


def _two_ranks(rank, world, path):
    from megatron.core import parallel_state

    from slime_hydra.train.megatron.backend import MegatronBackend

    forced = with_routing(toy_batch(), forced_routing(toy_batch()))
    ep2 = MegatronBackend(path, TrainConfig(**CFG, ep=2), total_steps=1)
    out = {"ep2": ep2.logprobs(forced.select(range(rank, forced.size, 2)))[0]}
    parallel_state.destroy_model_parallel()
    cp2 = MegatronBackend(path, TrainConfig(**CFG, cp=2), total_steps=1)
    out["cp2"] = cp2.logprobs(forced)[0]
    return out


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory.mktemp("replay_moe") / "model")


@pytest.fixture(scope="module")
def near_ties(path, tmp_path_factory):
    """The model with its router weights scaled by 0.05: router logits within ~0.1 of each other."""
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for router in moe_routers(model.model.layers).values():
            router.weight.mul_(0.05)
    out = tmp_path_factory.mktemp("near_ties") / "model"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine_batch(near_ties, tmp_path_factory):
    """Four sampled responses from an engine whose router weights are near_ties' + N(0, 1e-3) (tokens near a tie
    route differently), with its logprobs and routed experts."""
    root = tmp_path_factory.mktemp("replay_engine")
    model = AutoModelForCausalLM.from_pretrained(near_ties)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model.model.layers).values():
            router.weight.add_(1e-3 * torch.randn_like(router.weight))
    model.save_pretrained(root / "engine_model")
    engine = start_embedded_engine(str(root / "engine_model"), max_batch_size=4,
                                   extra_args=["--enable-return-routed-experts"], log_path=root / "engine.log")
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8], [6, 6, 2, 1, 9], [10, 20, 30]]

    async def run():
        async with SGLangClient(engine.url, timeout_s=120) as client:
            return await asyncio.gather(*(client.generate(
                p, {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": i},
                return_logprob=True) for i, p in enumerate(prompts)))

    try:
        answers = asyncio.run(run())
    finally:
        engine.stop()
    tokens = [p + a["output_ids"] for p, a in zip(prompts, answers)]
    batch = collate(tokens, [len(a["output_ids"]) for a in answers], [[1] * len(a["output_ids"]) for a in answers],
                    pad_id=0, extras={"rollout": [[x[0] for x in a["meta_info"]["output_token_logprobs"]]
                                                  for a in answers]},
                    routed_experts=[routed_experts.decode(a["meta_info"]["routed_experts"], LAYERS, TOP_K)
                                    for a in answers])
    batch.extras["experts"] = batch.routed_experts
    return batch


@pytest.fixture(scope="module")
def one_rank(path, engine_batch, near_ties):
    rollout = engine_batch.extras["rollout"].clone()
    out = run_ranks(1, _one_rank, path, engine_batch, near_ties, family_checkpoint("glm4_moe"))[0]
    return out, rollout, engine_batch.loss_mask


@pytest.fixture(scope="module")
def two_ranks(path):
    return run_ranks(2, _two_ranks, path)


def test_replaying_the_models_own_routing_changes_nothing(one_rank):
    out, _, _ = one_rank
    for backend in ("fsdp", "megatron"):
        assert torch.equal(out[backend]["own"], out[backend]["plain"]), backend


def test_fsdp_and_megatron_replay_an_arbitrary_routing_alike(one_rank):
    out, _, _ = one_rank
    assert (out["fsdp"]["forced"] - out["fsdp"]["plain"]).abs().max() > 0.05  # the routing matters
    torch.testing.assert_close(out["megatron"]["forced"], out["fsdp"]["forced"], atol=1e-5, rtol=0)
    for (loss_m, norm_m), (loss_f, norm_f) in zip(out["megatron"]["steps"], out["fsdp"]["steps"]):
        assert abs(loss_m - loss_f) <= 1e-5 * abs(loss_f) and abs(norm_m - norm_f) <= 1e-5 * norm_f
    assert out["fsdp"]["steps"][-1][0] < out["fsdp"]["steps"][0][0]  # it trains under the replayed routing
    glm = out["fsdp"]["glm"], out["megatron"]["glm"]  # sigmoid scores, renormalised and scaled; a shared expert
    assert (glm[0]["forced"] - glm[0]["plain"]).abs().max() > 0.05
    torch.testing.assert_close(glm[1]["forced"], glm[0]["forced"], atol=1e-5, rtol=0)


def test_packed_rows_replay_the_routing_as_padded_ones(one_rank):
    """train.pack_sequences: the routed experts travel with their tokens into the packed row (packing.pack)."""
    out, _, _ = one_rank
    for backend in ("fsdp", "megatron"):
        packed = out[backend]["packed"]
        torch.testing.assert_close(packed["forced"], out[backend]["forced"], atol=1e-5, rtol=1e-5)
        for (loss, norm), (want_loss, want_norm) in zip(packed["steps"], out[backend]["steps"]):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss) and abs(norm - want_norm) <= 1e-5 * want_norm


def test_megatron_ep2_and_cp2_replay_as_tp1(one_rank, two_ranks):
    tp1 = one_rank[0]["megatron"]["forced"]
    for rank, r in enumerate(two_ranks):
        rows = tp1[rank::2]
        width = r["ep2"].shape[1]  # a sub-batch is trimmed to its own longest response
        torch.testing.assert_close(r["ep2"], rows[:, :width], atol=1e-5, rtol=0)
        assert not rows[:, width:].any()
        torch.testing.assert_close(r["cp2"], tp1, atol=1e-5, rtol=0)


def test_replaying_the_engines_routing_closes_the_gap_its_flips_open(one_rank):
    out, rollout, mask = one_rank
    plain = ((out["engine"]["plain"] - rollout).abs() * mask).max()
    replayed = ((out["engine"]["replayed"] - rollout).abs() * mask).max()
    print(f"max engine-vs-trainer gap: {plain:.3g} routing anew, {replayed:.3g} replayed")
    assert plain > 0.05  # some token's experts flipped between engine and trainer
    assert replayed < plain / 10
