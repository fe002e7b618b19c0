"""The pinned option snapshots (``slime_hydra/snapshots``) hold what the real sources declare.

Facts checked against SGLang 0.5.23 (``sglang/srt/arg_groups/fields/*.py``, ``server_args.py``) and Megatron-LM
core_v0.16.1 (``megatron/training/arguments.py``, the dataclasses its ArgumentGroupFactory reads). Regenerate
with ``scripts/snapshot_passthrough.py``.
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


@pytest.fixture(scope="module")
def megatron() -> dict:
    return load("megatron_args")


@pytest.mark.parametrize("name", ["sglang_server_args", "megatron_args"])
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


def test_megatron_args(megatron):
    assert megatron["source_detail"]["ref"] == "core_v0.16.1"
    assert megatron["source_detail"]["megatron_core_version"] == "0.16.1"
    options = megatron["options"]
    assert len(options) > 300
    for name in ("tensor_model_parallel_size", "recompute_granularity", "micro_batch_size", "lr",
                 "pipeline_model_parallel_size", "seq_length", "bf16", "load", "save"):
        assert name in options, name
    assert options["recompute_granularity"]["choices"] == ["full", "selective"]
    assert options["recompute_granularity"]["flags"] == ["--recompute-granularity"]
    assert options["tensor_model_parallel_size"] == {
        **options["tensor_model_parallel_size"], "type": "int", "default": 1, "flags": ["--tensor-model-parallel-size"]}
    assert options["lr"]["type"] == "float" and options["lr"]["default"] is None
    assert options["micro_batch_size"]["type"] == "int"
    assert options["bf16"]["action"] == "store_true"


def test_megatron_dest_differs_from_flag(megatron):
    options = megatron["options"]
    # dataclass bool fields defaulting to True get --no-/--disable- flags (ArgumentGroupFactory)
    assert options["tp_comm_overlap_ag"]["flags"] == ["--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag"]
    assert options["tp_comm_overlap_ag"]["action"] == "store_false"
    # argparse_meta arg_names / explicit dest
    assert options["fp8"]["flags"] == ["--fp8-format"] and options["fp8"]["choices"] == ["e4m3", "hybrid"]
    assert options["add_bias_linear"]["flags"] == ["--disable-bias-linear"]
    assert options["enable_msc"]["flags"] == ["--disable-msc"]
    assert "fp8_format" not in options and "disable_bias_linear" not in options
    # only added when the kitchen extension imports
    assert options["kitchen_recipe_number"]["conditional"] == "HAVE_KITCHEN"
