"""The embedded engine serving a model with LoRA adapters (train.lora with adapter sync): B = 0 at start (the base
model's logprobs), its own adapter set in place by a tensor update (the logprobs of transformers + peft with that
adapter), named adapters through SGLang's /load_lora_adapter protocol (per-request ``lora_path``, batches in turns,
unload after the requests using it), partial or mismatched adapters refused, full HF checkpoints still loading under
their own names."""

import asyncio
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


async def _logprob_gap(url, model, lora_path=None) -> float:
    async with SGLangClient(url, timeout_s=120) as client:
        client.lora_path = lora_path
        resp = await client.generate(PROMPT, PARAMS, return_logprob=True)
    return _gap(resp, model)


def _gap(resp, model) -> float:
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
        with pytest.raises(EngineError, match="holds a LoRA adapter, not a model: load it with /load_lora_adapter"):
            await client.update_weights_from_disk(str(setup["root"] / "adapter"))


async def test_named_adapters_follow_sglangs_protocol(setup, tmp_path):
    """/load_lora_adapter, lora_path per request (a mixed batch runs in turns), /update_weight_version,
    /unload_lora_adapter: what the trainer's adapter sync to SGLang servers sends (rollout/weight_relay.py)."""
    url, adapter_dir = setup["url"], str(setup["root"] / "adapter")
    async with SGLangClient(url, timeout_s=120) as client:
        await client.update_weights_from_tensor(setup["adapter"], weight_version="7")  # the model's own adapter
        out = await client.load_lora_adapter("policy_v8", adapter_dir)
        assert out == {"success": True, "error_message": None, "loaded_adapters": {"policy_v8": adapter_dir}}
        with pytest.raises(EngineError, match="'policy_v8' is already loaded; unload it first") as info:
            await client.load_lora_adapter("policy_v8", adapter_dir)
        assert info.value.status == 400 and info.value.body["success"] is False

        wrong = tmp_path / "wrong"
        wrong.mkdir()
        config = json.loads((setup["root"] / "adapter" / "adapter_config.json").read_text())
        (wrong / "adapter_config.json").write_text(json.dumps({**config, "r": 8, "use_dora": True}))
        with pytest.raises(EngineError, match=r"r=8 differs from the served adapters' 4; use_dora=True is not "
                                              r"served \(only use_dora=False\)"):
            await client.load_lora_adapter("other", str(wrong))
        with pytest.raises(EngineError, match=r"LoRA adapter 'nope' is not loaded \(loaded: \['policy_v8'\]\)"):
            client.lora_path = "nope"
            await client.generate(PROMPT, PARAMS, return_logprob=True)

        # one batch, three adapters: the named one, the model's own (none named), and again the named one
        client.lora_path = None
        batch = await client.request("POST", "/generate", {
            "input_ids": [PROMPT] * 3, "sampling_params": PARAMS, "return_logprob": True,
            "lora_path": ["policy_v8", None, "policy_v8"], "rid": ["a", "b", "c"]})
        # the named adapter is the saved one, the own one the same tensors: both give transformers + peft's
        assert max(_gap(r, setup["peft"]) for r in batch) < 1e-5
        await client.update_weights_from_tensor({k: torch.zeros_like(v) if k.endswith("lora_B.weight") else v
                                                 for k, v in setup["adapter"].items()}, weight_version="8")
        assert await _logprob_gap(url, setup["plain"]) < 1e-5  # own adapter zeroed: the base
        assert await _logprob_gap(url, setup["peft"], "policy_v8") < 1e-5  # the named one untouched
        assert await _logprob_gap(url, setup["plain"]) < 1e-5  # ... and put back

        assert await client.update_weight_version("9") == {"success": True, "message": "Weight version updated to 9",
                                                           "new_version": "9"}
        assert await client.get_weight_version() == "9"
        out = await client.unload_lora_adapter("policy_v8")
        assert out["loaded_adapters"] == {}
        with pytest.raises(EngineError, match="'policy_v8' is not loaded"):
            await client.unload_lora_adapter("policy_v8")


async def test_an_unload_waits_for_the_requests_using_the_adapter(setup):
    """A request held by a pause keeps its adapter: the unload refuses the name to new requests at once but returns
    only once that request has finished."""
    url = setup["url"]
    async with SGLangClient(url, timeout_s=120) as client:
        await client.load_lora_adapter("old", str(setup["root"] / "adapter"))
        await client.pause_generation("in_place")
        client.lora_path = "old"
        running = asyncio.create_task(client.generate(PROMPT, PARAMS, return_logprob=True))
        async with asyncio.timeout(60):
            while (await client.get_load())[0]["num_reqs"] == 0:
                await asyncio.sleep(0.01)
        unload = asyncio.create_task(client.unload_lora_adapter("old"))
        async with asyncio.timeout(60):
            while "old" in (await client.server_info())["lora_adapters"]:
                await asyncio.sleep(0.01)
        with pytest.raises(EngineError, match="'old' is not loaded"):  # refused to new requests at once
            await client.generate(PROMPT, PARAMS)
        await asyncio.sleep(0.2)
        assert not unload.done() and not running.done()
        await client.continue_generation()
        resp = await running
        assert (await unload)["loaded_adapters"] == {}
    assert _gap(resp, setup["peft"]) < 1e-5


async def test_partial_adapters_are_refused_and_hf_names_still_load(setup, tmp_path):
    from safetensors.torch import save_file

    url, adapter = setup["url"], setup["adapter"]
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file(dict(list(adapter.items())[:3]), str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text((setup["root"] / "adapter" / "adapter_config.json").read_text())
    async with SGLangClient(url, timeout_s=120) as client:
        with pytest.raises(EngineError, match="missing adapter weights"):
            await client.load_lora_adapter("partial", str(partial))
        with pytest.raises(EngineError, match="unknown weight"):
            await client.update_weights_from_tensor({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight":
                                                     torch.zeros(4, 64)})
        # an HF checkpoint (names without PEFT's base_layer) loads into the base; the adapter is kept
        await client.update_weights_from_tensor(adapter, weight_version="4")
        await client.update_weights_from_tensor(read_checkpoint(str(setup["base"])), weight_version="5")
    assert await _logprob_gap(url, setup["peft"]) < 1e-5
