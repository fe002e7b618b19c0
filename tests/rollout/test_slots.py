"""The embedded engine's slot KV cache (engines/embedded/slots.py), driven in-process: more requests than slots,
prompts that make the cache grow, requests finishing at different steps (rows compacted), all against plain HF
forwards."""

import asyncio

import pytest
import torch

from slime_hydra.rollout.engines.embedded import MIN_CAPACITY
from slime_hydra.rollout.engines.embedded.graphs import PrefillGraphs
from slime_hydra.rollout.engines.embedded.scheduler import Engine
from slime_hydra.rollout.engines.embedded.sampling import fused_draw
from slime_hydra.rollout.engines.embedded.slots import SlotKV, slot_attention

from .helpers import build_model, load, reference_greedy, reference_logprobs

# (prompt length, max_new_tokens): six requests through four slots; the 200-token prompt grows the cache past 128.
CASES = [(3, 5), (7, 30), (12, 8), (5, 150), (9, 2), (200, 10)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("slots") / "m", seed=0)


@pytest.mark.parametrize("compiled,padded", [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "padded-prefill"])
def test_queued_growing_and_compacted_rows_match_plain_forwards(model_dir, compiled, padded):
    """Also with the decoder layers torch.compiled for decode (the default on CUDA), through batch sizes 1..4 (a
    static and a dynamic-batch compile) and the attention window growing from 128 to 256 columns; and with prefills
    in the CUDA-graph layout (graphs.PrefillGraphs, run eagerly here): rows padded to a power-of-two bucket, the
    padding rows writing to the scratch slot, the width padded to a power of two (256 for the 200-token prompt)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n, _ in CASES]

    async def run():
        engine = Engine(str(model_dir), max_batch_size=4, torch_compile=compiled)
        runner = engine.runner
        if padded:
            runner.prefill_graphs = PrefillGraphs(runner._prefill_forward, runner._head, 4, runner.device,
                                                  capture=False)
        await engine.start()
        try:
            reqs = [engine.make_request(p, {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}, None, True,
                                        -1, 0, False) for p, (_, m) in zip(prompts, CASES)]
            engine.submit(reqs)
            outs = await asyncio.gather(*(r.future for r in reqs))
            return outs, engine.runner.kv.capacity, engine.runner.peak_running
        finally:
            await engine.stop()

    outs, capacity, peak = asyncio.run(run())
    assert peak == 4 and capacity == 256  # 200 + 10 tokens: the next power of two
    model = load(model_dir)
    for prompt, (_, m), out in zip(prompts, CASES, outs):
        assert out["output_ids"] == reference_greedy(model, prompt, m)
        ref, _ = reference_logprobs(model, prompt, out["output_ids"])
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5


def test_padded_prefill_rows_leave_running_slots_alone(model_dir):
    """A prefill in the CUDA-graph layout pads 3 admitted prompts to a bucket of 4 rows while a request already runs in
    slot 0: the padding row writes to the scratch slot, and every request still decodes what plain forwards give."""
    from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams
    from slime_hydra.rollout.engines.embedded.runner import ModelRunner

    prompts, lengths = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]], [12, 6, 8, 5]

    async def run() -> list[list[int]]:
        runner = ModelRunner(str(model_dir), "cpu", "float32", 4, None, None, "0", cuda_graph=False)
        runner.prefill_graphs = PrefillGraphs(runner._prefill_forward, runner._head, 4, runner.device, capture=False)
        reqs = [Request(f"r{i}", p, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n}), False, -1, 0,
                        False, None) for i, (p, n) in enumerate(zip(prompts, lengths))]
        runner.step(reqs[:1])
        for _ in range(3):
            runner.step([])
        runner.step(reqs[1:])  # slots 1-3, padded to 4 rows
        while runner.running:
            runner.step([])
        return [r.output_ids for r in reqs]

    model = load(model_dir)
    assert asyncio.run(run()) == [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]


def test_compact_moves_the_last_rows_into_the_holes(model_dir):
    kv = SlotKV(load(model_dir).config, slots=6, dtype=torch.float32, device=torch.device("cpu"), max_capacity=4096)
    kv.reserve(10)
    # 6 slots and the scratch slot
    assert kv.capacity == MIN_CAPACITY and kv.k.shape == kv.v.shape == (2, 7, 2, MIN_CAPACITY, 16)
    for slot in range(6):
        kv.k[:, slot], kv.v[:, slot] = slot, -slot
        kv.pos[slot], kv.ids[slot] = 100 + slot, 200 + slot
    moves = kv.compact([0, 2, 4, 5])  # rows 1 and 3 finished; rows 4 and 5 move into slots 1 and 3
    assert moves == [(4, 1), (5, 3)]
    assert [int(kv.k[0, s, 0, 0, 0]) for s in range(4)] == [0, 4, 2, 5]
    assert [int(kv.v[1, s, 1, 5, 3]) for s in range(4)] == [0, -4, -2, -5]
    assert kv.pos[:4].tolist() == [100, 104, 102, 105] and kv.ids[:4].tolist() == [200, 204, 202, 205]
    with pytest.raises(ValueError, match="exceed the context length 4096"):
        kv.reserve(5000)


def test_unsupported_attention_variants_are_refused():
    q = k = v = torch.zeros(1, 2, 3, 4)

    class Layer:
        layer_idx = 0

    with pytest.raises(NotImplementedError, match="sliding_window.*rollout=sglang"):
        slot_attention(Layer(), q, k, v, None, sliding_window=4)


def _spread_logits() -> torch.Tensor:
    """1,000 tokens (not a multiple of SEARCH_BLOCKS, so the last block is padded) with the mass on a few tokens in
    different blocks, the first and the last token among them."""
    logits = torch.full((1000,), -4.0)
    logits[[0, 31, 32, 500, 968, 999]] = torch.tensor([2.0, 1.0, 0.0, 1.5, -1.0, 0.5])
    return logits


@pytest.mark.parametrize("row", [torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5]), _spread_logits()], ids=["5", "1000"])
def test_fused_draw_samples_the_tempered_softmax(row):
    """The compiled plain sampler (an inverse-CDF search in blocks) draws from softmax(logits / T) and returns
    log_softmax(logits / T) at the drawn tokens: 20,000 draws land within 0.015 of every token's probability."""
    torch.manual_seed(0)
    logits = row.to(torch.bfloat16).repeat(20_000, 1)
    temperature = torch.full((20_000,), 0.7)
    tokens, chosen = torch.compile(fused_draw)(logits, temperature)
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1)
    assert int(tokens.max()) < len(row)
    assert torch.allclose(chosen, expected.gather(1, tokens[:, None])[:, 0], atol=1e-6)
    freq = torch.bincount(tokens, minlength=len(row)).float() / 20_000
    assert (freq - expected[0].exp()).abs().max() < 0.015


def test_compiled_decode_keeps_eager_bf16_numerics(model_dir):
    """The compiled decode step rounds to bf16 after every op as eager kernels do (inductor's
    emulate_precision_casts): its logits equal the eager step's bitwise, so the engine samples from the distribution
    the (eager-numerics) trainer scores. Fused without it they differ by ~3e-3 here, and the colocated GPU loop's
    engine-vs-trainer gap grew threefold."""
    from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams
    from slime_hydra.rollout.engines.embedded.runner import ModelRunner

    async def logits(compiled: bool) -> torch.Tensor:
        runner = ModelRunner(str(model_dir), "cpu", "bfloat16", 8, None, None, "0", cuda_graph=False,
                             torch_compile=compiled)
        params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 3})
        runner.step([Request(f"r{i}", list(range(1, 9 + i)), params, True, -1, 0, False, None) for i in range(5)])
        longest = max(r.num_tokens for r in runner.running)
        runner.kv.reserve(longest)
        return runner._decode_forward(5, runner.kv.window_for(longest))

    eager, compiled = asyncio.run(logits(False)), asyncio.run(logits(True))
    assert eager.dtype == torch.bfloat16 and torch.equal(compiled, eager)


def test_compiled_decode_is_not_compiled_again_for_a_smaller_batch(model_dir):
    """The compiled decode step is dynamic in the batch size from the first full batch on: decoding 5 of 8 slots
    after all 8 compiles nothing new. Under torch.compile's default duck sizing the full batch was traced with its size
    equal to the slot count, and the first smaller batch compiled the layers again (1.2 s mid-rollout on an H200)."""
    from torch._dynamo.utils import counters

    from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams
    from slime_hydra.rollout.engines.embedded.runner import ModelRunner

    async def compiles_per_batch() -> list[int]:
        runner = ModelRunner(str(model_dir), "cpu", "float32", 8, None, None, "0", cuda_graph=False,
                             torch_compile=True)
        params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4})  # greedy: the sampler stays eager
        graphs = []
        for n in (8, 8, 5, 3):
            before = counters["stats"]["unique_graphs"]
            runner.step([Request(f"{n}-{i}", list(range(1, 6)), params, False, -1, 0, False, None) for i in range(n)])
            while runner.running:
                runner.step([])
            graphs.append(counters["stats"]["unique_graphs"] - before)
        return graphs

    torch._dynamo.reset()  # earlier tests compiled the same layer code
    graphs = asyncio.run(compiles_per_batch())
    assert graphs[0] > 0 and graphs[1:] == [0, 0, 0]
