"""The embedded engine serving a mixture-of-experts model (model=tiny_moe's Qwen3-MoE layers, random init): its
logprobs are transformers' (the dense gate), and weight updates land whether they name the fused expert tensors the
model holds (tensor and broadcast syncs) or come as a checkpoint directory, whose files store one tensor per expert."""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from slime_hydra.config import compose, to_config
from slime_hydra.model.hf import build_random_checkpoint
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
