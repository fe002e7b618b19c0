"""The embedded engine serving mixture-of-experts models: model=tiny_moe's Qwen3-MoE layers (random init), whose
logprobs are transformers' (the dense gate), and whose weight updates land whether they name the fused expert tensors
the model holds (tensor and broadcast syncs) or come as a checkpoint directory, whose files store one tensor per
expert; and tiny GLM-4.5 and DeepSeek-V3 models (model/hf.py's random-init builder; the grouped sigmoid router with
a random correction bias, shared experts, a dense first layer; DeepSeek-V3's multi-latent attention, whose keys and
values differ in width), whose logprobs over concurrent requests (prefill of unequal prompts, batched decode) are
transformers'."""

import asyncio
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from slime_hydra.config import compose, to_config
from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint, hf_config
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from tests.rollout.helpers import load, logprobs, mean_abs_diff, reference_logprobs, tokens

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PARAMS = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 5}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_engine")
    model = to_config(compose(["model=tiny_moe"])).model
    a, b = (build_random_checkpoint(model, root / name, seed=seed) for name, seed in (("a", 0), ("b", 1)))
    engine = start_embedded_engine(str(a), log_path=root / "engine.log")
    yield dict(a=a, b=b, url=engine.url)
    engine.stop()


async def _gap(url: str, model_dir) -> float:
    async with SGLangClient(url, timeout_s=120) as client:
        resp = await client.generate(PROMPT, PARAMS, return_logprob=True)
    with torch.no_grad():
        expected, _ = reference_logprobs(load(model_dir), PROMPT, tokens(resp))
    return mean_abs_diff(logprobs(resp), expected)


async def test_moe_logprobs_and_weight_updates_in_both_layouts(setup):
    with safe_open(str(setup["b"] / "model.safetensors"), "pt") as f:  # the files' layout: one tensor per expert
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in f.keys()
    held = AutoModelForCausalLM.from_pretrained(setup["b"]).state_dict()  # the model's: fused per layer
    assert tuple(held["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 2 * 96, 128)

    assert await _gap(setup["url"], setup["a"]) < 1e-5
    assert await _gap(setup["url"], setup["b"]) > 1e-2
    async with SGLangClient(setup["url"], timeout_s=120) as client:
        await client.update_weights_from_disk(str(setup["b"]), weight_version="1")
    assert await _gap(setup["url"], setup["b"]) < 1e-5
    async with SGLangClient(setup["url"], timeout_s=120) as client:
        a = AutoModelForCausalLM.from_pretrained(setup["a"]).state_dict()
        del a["lm_head.weight"]  # tied to the embedding (one tensor, sent once)
        await client.update_weights_from_tensor(a, weight_version="2")
    assert await _gap(setup["url"], setup["a"]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_graphs_route_each_step_anew(tmp_path):
    """On CUDA the decode step replays CUDA graphs: a MoE layer's routing depends on the data, so each replay must
    route its own tokens (a graph that kept the capture's experts would drift from transformers at once). Six
    concurrent sampled requests against a plain CPU forward (fp32). In fp32 transformers' expert kernels read token
    counts back to the host, which a graph cannot hold: the engine finds that at capture and decodes eagerly; in bf16
    its grouped matmul captures, and the graphs must do as well as eager decoding."""
    import asyncio

    model = to_config(compose(["model=tiny_moe"])).model
    path = build_random_checkpoint(model, tmp_path / "m", seed=0)
    reference = load(path)  # a CPU forward
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6][: 2 + i] for i in range(6)]

    async def run(url: str) -> tuple[float, bool]:
        async with SGLangClient(url, timeout_s=300) as client:
            outs = await asyncio.gather(*(client.generate(p, {**PARAMS, "sampling_seed": i}, return_logprob=True)
                                          for i, p in enumerate(prompts)))
            graphs = (await client.server_info())["cuda_graph"]
        with torch.no_grad():
            gaps = [mean_abs_diff(logprobs(o), reference_logprobs(reference, p, tokens(o))[0])
                    for p, o in zip(prompts, outs)]
        return max(gaps), graphs

    found = {}
    for dtype in ("float32", "bfloat16"):
        for extra in ([], ["--disable-cuda-graph"]):
            engine = start_embedded_engine(str(path), device="cuda:0", dtype=dtype, max_batch_size=8,
                                           extra_args=extra, log_path=tmp_path / "engine.log")
            try:
                found[dtype, bool(extra)] = asyncio.run(run(engine.url))
            finally:
                engine.stop()
    print(found)
    assert found["float32", False] == (pytest.approx(found["float32", True][0], abs=1e-5), False)  # eager now
    assert found["float32", True][0] < 1e-4
    graph_gap, graphs = found["bfloat16", False]
    assert graphs and graph_gap < 2 * found["bfloat16", True][0] + 1e-3


TINY_GROUPED = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                           ffn_hidden_size=96, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=False,
                           num_experts=8, moe_top_k=4, moe_ffn_hidden_size=32, moe_shared_experts=1,
                           first_dense_layers=1, moe_groups=4, moe_group_top_k=2, moe_routed_scaling=2.5)
"""The grouped router's shape: 8 experts in 4 groups, 2 groups and 4 experts per token, one shared expert, layer 0
dense."""
FAMILIES = {
    "glm4_moe": replace(TINY_GROUPED, family="glm4_moe"),
    # multi-latent attention: keys 16 + 8 wide (8 with RoPE), values 12: the slot cache holds both widths
    "deepseek_v3": replace(TINY_GROUPED, family="deepseek_v3", num_kv_heads=4, head_dim=None, q_lora_rank=24,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
}
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9, 3]]


def spread_checkpoint(model: ModelConfig, out_dir):
    """model/hf.py's architecture with weights ~ N(0, 0.2), norms ~ U(0.8, 1.2) and the correction bias ~ N(0, 0.1),
    so router scores are far from ties (transformers' 0.02 init leaves the expert choice near-random)."""
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(hf_config(model), dtype=torch.float32)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        for name, b in net.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    net.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("family", FAMILIES)
async def test_grouped_router_families_logprobs_equal_transformers(family, tmp_path):
    path = spread_checkpoint(FAMILIES[family], tmp_path / family)
    engine = start_embedded_engine(str(path), log_path=tmp_path / "engine.log", max_batch_size=4)
    try:
        async with SGLangClient(engine.url, timeout_s=120) as client:
            outs = await asyncio.gather(*(client.generate(p, {**PARAMS, "max_new_tokens": 16, "sampling_seed": i},
                                                          return_logprob=True) for i, p in enumerate(PROMPTS)))
    finally:
        engine.stop()
    reference = load(path)
    with torch.no_grad():
        gaps = [mean_abs_diff(logprobs(o), reference_logprobs(reference, p, tokens(o))[0]) for p, o in zip(PROMPTS, outs)]
    print(family, "engine vs transformers, mean |logprob diff| per request:", gaps)
    assert max(gaps) < 1e-5 and all(len(tokens(o)) == 16 for o in outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_grouped_router_families_decode_graphs_as_eagerly(family, tmp_path):
    """GLM-4.5 and DeepSeek-V3 (keys and values of their own widths in the slot cache) on CUDA in bf16: the decode
    CUDA graphs (captured: bf16 expert kernels need no host read) give transformers' CPU fp32 logprobs as closely as
    eager decoding does."""
    path = spread_checkpoint(FAMILIES[family], tmp_path / family)
    reference = load(path)

    async def run(url: str) -> tuple[float, bool]:
        async with SGLangClient(url, timeout_s=300) as client:
            outs = await asyncio.gather(*(client.generate(p, {**PARAMS, "max_new_tokens": 16, "sampling_seed": i},
                                                          return_logprob=True) for i, p in enumerate(PROMPTS)))
            graphs = (await client.server_info())["cuda_graph"]
        with torch.no_grad():
            gaps = [mean_abs_diff(logprobs(o), reference_logprobs(reference, p, tokens(o))[0])
                    for p, o in zip(PROMPTS, outs)]
        return max(gaps), graphs

    found = {}
    for extra in ([], ["--disable-cuda-graph"]):
        engine = start_embedded_engine(str(path), device="cuda:0", dtype="bfloat16", max_batch_size=4,
                                       extra_args=extra, log_path=tmp_path / "engine.log")
        try:
            found[bool(extra)] = asyncio.run(run(engine.url))
        finally:
            engine.stop()
    print(family, found)
    (graph_gap, graphs), (eager_gap, _) = found[False], found[True]
    assert graphs and graph_gap < 2 * eager_gap + 1e-3
