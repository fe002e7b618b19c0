"""The embedded engine reports the experts its MoE routers chose (``--enable-return-routed-experts``): for every
position it ran (prompt + response - 1), every layer (-1 on the dense one), exactly the experts transformers'
forward of the whole sequence chooses; for concurrent sampled requests batched together, and a request may opt out.
Without the flag a request asking for them is refused, naming it."""

import asyncio
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from slime_hydra import routed_experts
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.engines.embedded.protocol import RequestError
from slime_hydra.rollout.engines.embedded.scheduler import Engine
from slime_hydra.train.routing_replay import moe_routers

LAYERS, TOP_K = 3, 2
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [11, 12, 13]]


def moe_checkpoint(out: Path) -> Path:
    """Tiny Qwen3-MoE (3 layers, the middle one dense; 4 experts, top-2) with weights ~ N(0, 0.2): router logits far
    from ties, so a prefill, a decode step and a full forward choose alike."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                            num_experts=4, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS, mlp_only_layers=[1],
                            tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out


def forward_experts(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), LAYERS, TOP_K] experts a plain transformers forward of ``ids`` chooses (-1 on dense layers)."""
    out = torch.full((len(ids), LAYERS, TOP_K), routed_experts.NO_EXPERT, dtype=torch.int16)
    def keep(layer, module, args, output):
        out[:, layer] = output[2]

    hooks = [router.register_forward_hook(partial(keep, i)) for i, router in moe_routers(model.model.layers).items()]
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device))
    for h in hooks:
        h.remove()
    return out


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory.mktemp("routed_moe") / "model")


def test_engine_reports_the_experts_of_every_position_run(path, tmp_path):
    engine = start_embedded_engine(str(path), max_batch_size=4, extra_args=["--enable-return-routed-experts"],
                                   log_path=tmp_path / "engine.log")
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}

    async def run():
        async with SGLangClient(engine.url, timeout_s=120) as client:
            answers = await asyncio.gather(*(client.generate(p, {**params, "sampling_seed": i})
                                             for i, p in enumerate(PROMPTS)))
            body = {"input_ids": PROMPTS[0], "sampling_params": params, "return_routed_experts": False}
            opted_out = await client.request("POST", "/generate", body)
        return answers, opted_out

    try:
        answers, opted_out = asyncio.run(run())
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, answer in zip(PROMPTS, answers):
        ids = prompt + answer["output_ids"]
        got = routed_experts.decode(answer["meta_info"]["routed_experts"], LAYERS, TOP_K)
        assert got.shape == (len(ids) - 1, LAYERS, TOP_K)
        assert (got[:, 1] == routed_experts.NO_EXPERT).all()  # the dense layer
        assert torch.equal(torch.from_numpy(got), forward_experts(model, ids[:-1]))
    assert "routed_experts" not in opted_out["meta_info"]


def test_a_request_for_routed_experts_needs_the_flag(path):
    async def ask():
        engine = Engine(str(path), max_batch_size=2)
        engine.make_request([1, 2, 3], None, None, False, -1, 0, False, return_routed_experts=True)

    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        asyncio.run(ask())


def test_wire_format_round_trips_and_refuses_another_shape():
    experts = torch.tensor([[[0, 3], [-1, -1], [2, 1]], [[1, 2], [-1, -1], [3, 0]]])
    text = routed_experts.encode(experts)
    assert torch.equal(torch.from_numpy(routed_experts.decode(text, 3, 2)).long(), experts)
    with pytest.raises(ValueError, match="another shape"):
        routed_experts.decode(text, 4, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_graphs_record_each_steps_experts(path, tmp_path):
    """Under CUDA graphs (bf16) the routers' hooks copy into a buffer the graphs write at every replay: the experts
    of every decoded position match a transformers forward of the whole sequence on the GPU (bf16 rounding may flip
    a rare near-tie: at least 99% of the entries), and not the capture's."""
    engine = start_embedded_engine(str(path), device="cuda:0", dtype="bfloat16", max_batch_size=4,
                                   extra_args=["--enable-return-routed-experts"], log_path=tmp_path / "engine.log")
    params = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}

    async def run():
        async with SGLangClient(engine.url, timeout_s=300) as client:
            answers = await asyncio.gather(*(client.generate(p, {**params, "sampling_seed": i})
                                             for i, p in enumerate(PROMPTS)))
            return answers, (await client.server_info())["cuda_graph"]

    try:
        answers, graphs = asyncio.run(run())
    finally:
        engine.stop()
    assert graphs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    same = total = 0
    for prompt, answer in zip(PROMPTS, answers):
        ids = prompt + answer["output_ids"]
        got = torch.from_numpy(routed_experts.decode(answer["meta_info"]["routed_experts"], LAYERS, TOP_K))
        want = forward_experts(model, ids[:-1])
        got, want = got.sort(-1).values, want.sort(-1).values  # the order of the top-k is not the choice
        same += int((got == want).all(-1).sum())
        total += got.shape[0] * LAYERS
    print(f"{same} of {total} (position, layer) choices equal")
    assert same >= 0.99 * total
