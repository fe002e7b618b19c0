"""The embedded engine serving a model with LoRA adapters (train.lora with adapter sync): B = 0 at start (the base
model's logprobs), adapters set by a tensor update or a PEFT directory on disk (the logprobs of transformers + peft
with that adapter), a partial adapter refused, full HF checkpoints still loading under their own names."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict

from slime_hydra.rollout.client import EngineError, SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.engines.embedded.server import read_checkpoint
from slime_hydra.weight_transport import split_adapter_key
from tests.rollout.helpers import build_model, load, logprobs, mean_abs_diff, reference_logprobs, tokens

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PARAMS = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 5}
ADAPTER = dict(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = build_model(root / "base", seed=0)
    torch.manual_seed(1)
    # init_lora_weights=False: B random too, so the adapter changes the function
    peft_model = get_peft_model(load(base), LoraConfig(**ADAPTER, init_lora_weights=False)).eval()
    peft_model.save_pretrained(root / "adapter")
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    engine = start_embedded_engine(str(base), extra_args=["--lora-config", json.dumps(config)],
                                   log_path=root / "engine.log")
    yield dict(base=base, root=root, peft=peft_model, adapter=adapter, url=engine.url, plain=load(base))
    engine.stop()


async def _logprob_gap(url, model) -> float:
    async with SGLangClient(url, timeout_s=120) as client:
        resp = await client.generate(PROMPT, PARAMS, return_logprob=True)
    with torch.no_grad():
        expected, _ = reference_logprobs(model, PROMPT, tokens(resp))
    return mean_abs_diff(logprobs(resp), expected)


async def test_adapters_start_at_zero_and_load_from_tensors_and_disk(setup):
    url, adapter = setup["url"], setup["adapter"]
    assert all(split_adapter_key(k) for k in adapter) and len(adapter) == 2 * 2 * 3  # 2 layers x 3 modules x A, B
    assert await _logprob_gap(url, setup["plain"]) < 1e-5  # B = 0: the base model
    assert await _logprob_gap(url, setup["peft"]) > 1e-2  # ... which this adapter changes

    async with SGLangClient(url, timeout_s=120) as client:
        await client.update_weights_from_tensor(adapter, weight_version="1")
    assert await _logprob_gap(url, setup["peft"]) < 1e-5  # W x + s B A x, as transformers + peft compute it

    async with SGLangClient(url, timeout_s=120) as client:
        zeros = {k: torch.zeros_like(v) if k.endswith("lora_B.weight") else v for k, v in adapter.items()}
        await client.update_weights_from_tensor(zeros, weight_version="2")
        assert await _logprob_gap(url, setup["plain"]) < 1e-5
        info = await client.update_weights_from_disk(str(setup["root"] / "adapter"), weight_version="3")
        assert info["weight_version"] == "3"
        assert (await client.model_info())["model_path"] == str(setup["base"].resolve())  # the base stays
    assert await _logprob_gap(url, setup["peft"]) < 1e-5


async def test_partial_adapters_are_refused_and_hf_names_still_load(setup, tmp_path):
    from safetensors.torch import save_file

    url, adapter = setup["url"], setup["adapter"]
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file(dict(list(adapter.items())[:3]), str(partial / "adapter_model.safetensors"))
    async with SGLangClient(url, timeout_s=120) as client:
        with pytest.raises(EngineError, match="missing weights"):
            await client.update_weights_from_disk(str(partial))
        with pytest.raises(EngineError, match="unknown weight"):
            await client.update_weights_from_tensor({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight":
                                                     torch.zeros(4, 64)})
        # an HF checkpoint (names without PEFT's base_layer) loads into the base; the adapter is kept
        await client.update_weights_from_tensor(adapter, weight_version="4")
        await client.update_weights_from_tensor(read_checkpoint(str(setup["base"])), weight_version="5")
    assert await _logprob_gap(url, setup["peft"]) < 1e-5
