"""The pinned option snapshots (``slime_hydra/snapshots``) hold what the real sources declare.

Facts checked against SGLang 0.5.23 (``sglang/srt/arg_groups/fields/*.py``, ``server_args.py``). Regenerate with
``scripts/snapshot_passthrough.py``. (train.megatron is checked against megatron-core's installed TransformerConfig.)
"""

import json
from importlib import resources

import pytest

SNAPSHOTS = resources.files("slime_hydra").joinpath("snapshots")


def load(name: str) -> dict:
    return json.loads(SNAPSHOTS.joinpath(f"{name}.json").read_text())


@pytest.fixture(scope="module")
def sglang() -> dict:
    return load("sglang_server_args")


@pytest.mark.parametrize("name", ["sglang_server_args"])
def test_layout(name):
    text = SNAPSHOTS.joinpath(f"{name}.json").read_text()
    snap = json.loads(text)
    assert len(text.encode()) < 1_000_000
    assert snap["generated_by"] == "scripts/snapshot_passthrough.py"
    assert snap["source"] and snap["version"]
    options = snap["options"]
    assert list(options) == sorted(options)
    for opt in options.values():
        assert isinstance(opt["flags"], list)
        assert {"type", "default", "flags", "choices"} <= set(opt)


def test_sglang_fields(sglang):
    assert sglang["version"] == "0.5.23"
    assert sglang["source"] == "sglang.srt.server_args.ServerArgs"
    options = sglang["options"]
    assert len(options) == 546  # == len(POSITIONAL_FIELD_ORDER) in 0.5.23
    for name in ("mem_fraction_static", "tp_size", "model_path", "port", "chunked_prefill_size",
                 "context_length", "random_seed", "attention_backend", "enable_dp_attention"):
        assert name in options, name
    assert "float" in options["mem_fraction_static"]["type"]
    assert options["mem_fraction_static"]["default"] is None  # resolved from the GPU memory at start-up
    assert options["port"] == {**options["port"], "type": "int", "default": 30000, "flags": ["--port"]}
    assert options["model_path"]["required"] is True
    assert "float" not in options["chunked_prefill_size"]["type"] and "int" in options["chunked_prefill_size"]["type"]


def test_sglang_flags(sglang):
    options = sglang["options"]
    # add_cli_args_from_dataclass: '--' + name with '_' -> '-', then Arg.aliases
    assert options["tp_size"]["flags"] == ["--tp-size", "--tensor-parallel-size"]
    assert options["model_path"]["flags"] == ["--model-path", "--model"]
    # Arg(cli_name=...) renames the flag
    assert options["fp8_gemm_runner_backend"]["flags"] == ["--fp8-gemm-backend"]
    # Arg(no_cli=True): a field without a flag
    assert options["watermark_key"]["flags"] == []
    # registered by hand in ServerArgs.add_cli_args, a deprecated spelling
    assert options["enable_dp_attention"]["flags"] == ["--enable-dp-attention"]
    assert options["enable_dp_attention"]["deprecated_flags"] == ["--enable-dp-attention"]
    assert "config" in sglang["cli_only"] and "config" not in options
    assert "flashinfer" in options["attention_backend"]["choices"]
    assert options["load_format"]["default"] == "auto" and "safetensors" in options["load_format"]["choices"]
