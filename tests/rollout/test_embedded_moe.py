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
    route its own tokens (a graph that kept the capture's experts would drift from transformers at once). fp32:
    six concurrent sampled requests against a plain CPU forward; eager (no graphs) beside it."""
    import asyncio

    model = to_config(compose(["model=tiny_moe"])).model
    path = build_random_checkpoint(model, tmp_path / "m", seed=0)
    reference = load(path)  # a CPU forward
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6][: 2 + i] for i in range(6)]

    async def gaps(url: str) -> list[float]:
        async with SGLangClient(url, timeout_s=300) as client:
            outs = await asyncio.gather(*(client.generate(p, {**PARAMS, "sampling_seed": i}, return_logprob=True)
                                          for i, p in enumerate(prompts)))
        with torch.no_grad():
            return [mean_abs_diff(logprobs(o), reference_logprobs(reference, p, tokens(o))[0])
                    for p, o in zip(prompts, outs)]

    for extra in ([], ["--disable-cuda-graph"]):
        engine = start_embedded_engine(str(path), device="cuda:0", dtype="float32", max_batch_size=8,
                                       extra_args=extra, log_path=tmp_path / "engine.log")
        try:
            assert max(asyncio.run(gaps(engine.url))) < 1e-3, extra  # a wrong expert moves logprobs by ~0.1
        finally:
            engine.stop()
