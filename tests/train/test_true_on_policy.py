"""algo.true_on_policy on CPU (model/invariant.py): the batch-invariant engine samples responses whose requests share
prefills and decode steps in changing company (more requests than slots, prompts of 3 to 100 tokens, responses
finishing at different steps), and the batch-invariant trainer's logprobs of those tokens are the engine's, bit for
bit: padded and packed micro-batches of other sizes, one rank and two FSDP ranks. Without the mode, the same
comparison is not exact (the mode is what makes it so). And what deterministic=true rests on: with a seed per request,
the batch-invariant engine samples every request's tokens alike whatever order and company it comes in."""

import asyncio

import pytest
import torch

from slime_hydra.model.families import FAMILIES
from slime_hydra.rollout.engines.embedded.scheduler import Engine
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.train.megatron.backend import MegatronBackend
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch

DENSE = [f.name for f in FAMILIES.values() if not f.moe and not f.latent_attention and "embedded" in f.engines]
"""The families algo.true_on_policy covers: every dense one the embedded engine serves."""
TEMPERATURE = 0.8
CASES = [(3, 40), (17, 6), (100, 20), (5, 25), (40, 3), (9, 30), (64, 9), (4, 1), (30, 16)]
"""(prompt tokens, max_new_tokens): nine requests through four slots."""


@pytest.fixture(scope="module")
def model_dir():
    return tiny_checkpoint()


def generate(path, batch_invariant: bool, slots: int = 4, reverse: bool = False,
             device: str = "cpu") -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, response, engine logprobs) of each case, sampled with a seed per request, the requests submitted in
    CASES' order (or reversed) to an engine of ``slots`` slots (on a GPU: bf16, CUDA graphs)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n, _ in CASES]
    order = list(range(len(CASES)))[::-1 if reverse else 1]

    async def run():
        engine = Engine(str(path), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                        max_batch_size=slots, batch_invariant=batch_invariant)
        await engine.start()
        try:
            reqs = {i: engine.make_request(prompts[i], {"temperature": TEMPERATURE, "max_new_tokens": CASES[i][1],
                                                        "ignore_eos": True, "sampling_seed": i}, None, True, -1, 0,
                                           False) for i in order}
            engine.submit(list(reqs.values()))
            outs = await asyncio.gather(*(reqs[i].future for i in range(len(CASES))))
            return outs, engine.runner.peak_running
        finally:
            await engine.stop()

    outs, peak = asyncio.run(run())
    assert peak == slots
    return [(p, o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for p, o in zip(prompts, outs)]


def _trainer_logprobs(rank, world, path, samples, batch_invariant, packed, device="cpu", kind="fsdp"):
    train = TrainConfig(dtype="bf16" if device == "cuda" else "fp32", micro_batch_samples=2, pack_sequences=packed)
    Backend = MegatronBackend if kind == "megatron" else FSDPBackend
    backend = Backend(path, train, total_steps=1, batch_invariant=batch_invariant, device=device)
    batch = collate([p + r for p, r, _ in samples], [len(r) for _, r, _ in samples],
                    [[1] * len(r) for _, r, _ in samples], pad_id=0)
    logp, _ = backend.logprobs(batch, temperature=TEMPERATURE)
    return logp.cpu()


def differences(samples, logp) -> list[float]:
    return [abs(float(logp[i, j]) - engine) for i, (_, r, lps) in enumerate(samples) for j, engine in enumerate(lps)]


@pytest.mark.parametrize("kind,world,packed", [("fsdp", 1, False), ("fsdp", 1, True), ("fsdp", 2, True),
                                               ("megatron", 1, False), ("megatron", 1, True), ("megatron", 2, False)],
                         ids=["padded", "packed", "fsdp-dp2", "megatron-padded", "megatron-packed", "megatron-dp2"])
def test_trainer_logprobs_equal_the_engines_bit_for_bit(model_dir, kind, world, packed):
    samples = generate(model_dir, batch_invariant=True)
    assert sum(len(r) for _, r, _ in samples) == sum(m for _, m in CASES)
    logp = run_ranks(world, _trainer_logprobs, model_dir, samples, True, packed, "cpu", kind)[0]
    assert max(differences(samples, logp)) == 0.0


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
@pytest.mark.parametrize("family", [f for f in DENSE if f != "qwen2"])  # qwen2 (the tiny model's): above
def test_every_dense_family_is_exact(family, kind):
    """Each family's own ops in both forwards: Qwen3's q/k norms, Llama's unbiased projections, GLM-4's sandwich
    norms, fused gate/up and interleaved partial RoPE."""
    path = tiny_checkpoint(family)
    samples = generate(path, batch_invariant=True)
    assert max(differences(samples, run_ranks(1, _trainer_logprobs, path, samples, True, True, "cpu", kind)[0])) == 0.0


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_without_the_mode_the_logprobs_differ_by_rounding(model_dir, kind):
    samples = generate(model_dir, batch_invariant=False)
    gaps = differences(samples, run_ranks(1, _trainer_logprobs, model_dir, samples, False, True, "cpu", kind)[0])
    assert 0.0 < max(gaps) < 1e-4


def test_seeded_requests_sample_alike_in_any_order_and_company(model_dir):
    assert generate(model_dir, True, slots=3, reverse=True) == generate(model_dir, True)


def _two_steps(rank, world, path, batch_invariant, packed):
    train = TrainConfig(dtype="fp32", lr=1e-2, micro_batch_samples=3, pack_sequences=packed)
    backend = FSDPBackend(path, train, total_steps=2, batch_invariant=batch_invariant, device="cpu")
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(toy_batch(), pg_loss) for _ in range(2))]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_invariant_forward_trains_as_the_plain_one(model_dir, packed):
    """Its backward is plain causal attention's (invariant.DecodeFormAttention) through tiled matmuls and tree-summed
    norms: the same losses and gradient norms as the default forward, to fp32 rounding, over two steps."""
    plain = run_ranks(1, _two_steps, model_dir, False, packed)[0]
    for (loss, norm), (want_loss, want_norm) in zip(run_ranks(1, _two_steps, model_dir, True, packed)[0], plain):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6) and norm == pytest.approx(want_norm, rel=1e-5)
    assert plain[1][0] < plain[0][0]


def _flags_in_forward(rank, world, path, kind):
    """torch's deterministic-algorithms flag inside each model forward of a logprobs pass and a training step, with
    the flag on around them (as deterministic=true sets it: TrainRank.setup), and the flag afterwards."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    Backend = MegatronBackend if kind == "megatron" else FSDPBackend
    backend = Backend(path, TrainConfig(dtype="fp32", micro_batch_samples=4), total_steps=1, batch_invariant=True,
                      device="cpu")
    seen = []
    backend.model.register_forward_hook(lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    backend.logprobs(toy_batch())
    backend.train_step(toy_batch(), pg_loss)
    return seen, torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_the_forward_runs_the_engines_kernels_under_deterministic_algorithms(model_dir, kind):
    """On an H200 torch's deterministic algorithms changed the bits of the trainer's forward (4 of 16 sequences, up to
    0.0019 nats from the engine's): the forward runs the engine's default kernels (invariant.engine_kernels), the
    loss, the backward and the optimizer step the deterministic ones."""
    seen, after, warn_only = run_ranks(1, _flags_in_forward, model_dir, kind)[0]
    assert seen == [False] * 4  # two micro-batches of 4 in each pass
    assert after and warn_only
