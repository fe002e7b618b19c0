"""rollout=sglang: the exact SGLang command lines, the options refused, and the launch path run for real.

SGLang itself cannot run here (no GPU, and it pins its own torch): the rendered argv is checked token by token against
what SGLang 0.5.23's argparse parser reads (flag spellings from the pinned ServerArgs snapshot), and the process path
the SGLang command takes (EngineActor -> ServerProcess -> /health_generate -> restart -> stop) is exercised by the
embedded engine, which speaks the same protocol.
"""

import asyncio
import stat
import sys
from pathlib import Path

import pytest
import ray
import yaml
from ray.util.placement_group import placement_group

from slime_hydra.config import ConfigError, collect_problems, compose, derive, to_config
from slime_hydra.rollout.auth import API_KEY_ENV, new_api_key
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import ServerProcess
from slime_hydra.rollout.engines.actor import EngineActor, engine_gpu_ids
from slime_hydra.launch.sglang_commands import main
from slime_hydra.options import snapshot
from slime_hydra.rollout.engines.sglang import (
    SGLangLaunch, api_key_config, engine_commands, launch_for, render_options,
)
from slime_hydra.rollout.router import Router
from tests.rollout.helpers import build_model

BASE = ["python", "-m", "sglang.launch_server", "--model-path", "/ckpt/q", "--tokenizer-path", "/ckpt/q",
        "--host", "10.0.0.5", "--port", "30000", "--nccl-port", "30001"]


def launch(**overrides) -> SGLangLaunch:
    fields = dict(model_path="/ckpt/q", tp_size=1, dtype="bfloat16", seed=42, context_tokens=4096)
    fields.update(overrides)
    return SGLangLaunch(**fields)


def command(index: int = 0, **overrides) -> list[str]:
    return launch(**overrides).command(index, "10.0.0.5", 30000, 30001, python="python")


def problem_lines(options: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        render_options(options)
    return [str(p) for p in info.value.problems]


# ---- exact argv ----------------------------------------------------------------------------------------------------

def test_platform_flags_exact():
    assert command() == BASE + ["--tp-size", "1", "--dtype", "bfloat16", "--random-seed", "42",
                                "--context-length", "4096", "--weight-version", "0"]


def test_tp_seed_offset_memory_saver_exact():
    argv = launch(tp_size=4, dtype="float32", memory_saver=True).command(3, "127.0.0.1", 41000, 41001, "7",
                                                                         python="/venv/bin/python")
    assert argv == ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/q", "--tokenizer-path",
                    "/ckpt/q", "--host", "127.0.0.1", "--port", "41000", "--nccl-port", "41001", "--tp-size", "4",
                    "--dtype", "float32", "--random-seed", "45", "--context-length", "4096", "--weight-version", "7",
                    "--enable-memory-saver"]


def test_bool_flags():
    # store_true: only when true; BooleanOptionalAction: --x / --no-x; Optional[bool] without action: store_true
    assert render_options({"enable_torch_compile": True, "disable_radix_cache": False, "skip_server_warmup": True,
                           "enable_tf32_matmul": False, "lora_strict_loading": True,
                           "enable_lora_overlap_loading": True}) == [
        "--enable-torch-compile", "--skip-server-warmup", "--no-enable-tf32-matmul", "--lora-strict-loading",
        "--enable-lora-overlap-loading"]


def test_lists_one_flag_then_values():
    assert render_options({"cuda_graph_bs_decode": [1, 2, 4, 8], "flashinfer_autotune_skip_ops": ["a", "b"],
                           "uvicorn_access_log_exclude_prefixes": [], "bucket_time_to_first_token": [0.1, 2.5]}) == [
        "--cuda-graph-bs-decode", "1", "2", "4", "8", "--flashinfer-autotune-skip-ops", "a", "b",
        "--uvicorn-access-log-exclude-prefixes", "--bucket-time-to-first-token", "0.1", "2.5"]


def test_dicts_and_json_options():
    assert render_options({
        "extra_metric_labels": {"team": "rl", "run": "7"},
        "cuda_graph_config": {"decode": {"max_bs": 256}},
        "forward_hooks": [{"name": "h", "target_modules": ["m"]}],
        "preferred_sampling_params": {"temperature": 0.6},
        "default_chat_template_kwargs": '{"enable_thinking": false}',
    }) == ["--extra-metric-labels", '{"team":"rl","run":"7"}',
           "--cuda-graph-config", '{"decode":{"max_bs":256}}',
           "--forward-hooks", '[{"name":"h","target_modules":["m"]}]',
           "--preferred-sampling-params", '{"temperature":0.6}',
           "--default-chat-template-kwargs", '{"enable_thinking": false}']


def test_scalars_lora_and_order_kept():
    assert render_options({"mem_fraction_static": 0.85, "max_running_requests": 512, "attention_backend": "fa3",
                           "max_total_tokens": "32k", "lora_paths": {"sql": "/lora/sql", "math": "/lora/math"},
                           "json_model_override_args": '{"rope_scaling": null}', "schedule_policy": "lpm",
                           "disable_radix_cache": None}) == [
        "--mem-fraction-static", "0.85", "--max-running-requests", "512", "--attention-backend", "fa3",
        "--max-total-tokens", "32k", "--lora-paths", "sql=/lora/sql", "math=/lora/math",
        "--json-model-override-args", '{"rope_scaling": null}', "--schedule-policy", "lpm"]
    assert render_options({"lora_paths": ["/lora/a", {"lora_name": "b", "lora_path": "/lora/b"}]}) == [
        "--lora-paths", "/lora/a", '{"lora_name":"b","lora_path":"/lora/b"}']


def test_passthrough_follows_platform_flags():
    argv = command(1, tp_size=2, options={"mem_fraction_static": 0.7, "enable_torch_compile": True})
    assert argv == BASE + ["--tp-size", "2", "--dtype", "bfloat16", "--random-seed", "43", "--context-length", "4096",
                           "--weight-version", "0", "--mem-fraction-static", "0.7", "--enable-torch-compile"]


# ---- refused -------------------------------------------------------------------------------------------------------

def test_owned_keys_refused_naming_the_owner():
    assert problem_lines({"tp_size": 2, "port": 1, "dtype": "half", "weight_version": "3", "model_path": "/x"}) == [
        "[rollout.sglang.tp_size] 'tp_size' is owned by the platform; use rollout.gpus_per_engine instead",
        "[rollout.sglang.port] 'port' is owned by the platform; use set by the platform from the Ray placement "
        "(it picks ports, GPUs and addresses per engine) instead",
        "[rollout.sglang.dtype] 'dtype' is owned by the platform; use train.dtype (engines compute in the dtype "
        "weights are synced in) instead",
        "[rollout.sglang.weight_version] 'weight_version' is owned by the platform; use the trainer's step "
        "(set by every weight sync) instead",
        "[rollout.sglang.model_path] 'model_path' is owned by the platform; use model.path instead",
    ]
    assert problem_lines({"api_key": "k", "admin_api_key": "a"}) == [
        "[rollout.sglang.api_key] 'api_key' is owned by the platform; use the run's own key (rollout/auth.py: "
        "generated per run, given through --config) instead",
        "[rollout.sglang.admin_api_key] 'admin_api_key' is owned by the platform; use the run's own key "
        "(rollout/auth.py: an admin key would lock the trainer out of weight updates) instead",
    ]


def test_several_tokenizer_workers_refused():
    """SGLang 0.5.23 asserts that no API key is set in multi-tokenizer mode, and every engine gets the run's key."""
    assert problem_lines({"tokenizer_worker_num": 2}) == [
        "[rollout.sglang.tokenizer_worker_num] SGLang 0.5.23 refuses an API key with several tokenizer workers, and "
        "every engine of a run requires the run's key; remove rollout.sglang.tokenizer_worker_num (1 worker)"]
    assert render_options({"tokenizer_worker_num": 1}) == ["--tokenizer-worker-num", "1"]


def test_bad_values_refused_with_the_fix():
    assert problem_lines({
        "mem_fraction_statc": 0.5, "cuda_graph_bs_decode": 8, "attention_backend": "fa9", "max_running_requests": True,
        "mem_fraction_static": "high", "enable_torch_compile": "yes", "flashinfer_autotune_skip_ops": [],
        "watermark_key": "k", "modelopt_quant": {"a": 1},
    }) == [
        "[rollout.sglang.mem_fraction_statc] 'mem_fraction_statc' is not an option of "
        "sglang.srt.server_args.ServerArgs 0.5.23; did you mean rollout.sglang.mem_fraction_static?",
        "[rollout.sglang.cuda_graph_bs_decode] 'cuda_graph_bs_decode' takes a list, got 8 (SGLang 0.5.23); "
        "write rollout.sglang.cuda_graph_bs_decode as [a, b, ...]",
        "[rollout.sglang.attention_backend] 'attention_backend'='fa9' is not one of "
        + str(snapshot("sglang_server_args")["options"]["attention_backend"]["choices"]) + " (SGLang 0.5.23); set rollout.sglang.attention_backend "
        "to one of them",
        "[rollout.sglang.max_running_requests] 'max_running_requests' takes an integer, got True (SGLang 0.5.23); "
        "set rollout.sglang.max_running_requests to an integer",
        "[rollout.sglang.mem_fraction_static] 'mem_fraction_static' takes a number, got 'high' (SGLang 0.5.23); "
        "set rollout.sglang.mem_fraction_static to a number",
        "[rollout.sglang.enable_torch_compile] 'enable_torch_compile' takes true or false, got 'yes' "
        "(SGLang 0.5.23); set rollout.sglang.enable_torch_compile to true or false",
        "[rollout.sglang.flashinfer_autotune_skip_ops] 'flashinfer_autotune_skip_ops' needs at least one value on "
        "the command line (SGLang 0.5.23); remove rollout.sglang.flashinfer_autotune_skip_ops to keep SGLang's "
        "default",
        "[rollout.sglang.watermark_key] 'watermark_key' has no command-line flag (none: Arg(no_cli=True)) "
        "(SGLang 0.5.23); remove rollout.sglang.watermark_key: SGLang sets it internally",
        "[rollout.sglang.modelopt_quant] 'modelopt_quant' (Optional[Union[str, Dict]]) takes one plain value on the "
        "command line, got {'a': 1} (SGLang 0.5.23); set rollout.sglang.modelopt_quant to a string",
    ]


GPU = ["rollout=sglang", "cluster.gpus_per_node=8", "model=qwen2_5_0_5b", "model.path=/ckpt/Qwen2.5-0.5B"]


def test_validation_refuses_bad_values_before_launch():
    cfg = to_config(compose([*GPU, "rollout.num_gpus=2", "+rollout.sglang.cuda_graph_bs_decode=4"]))
    problems, _ = collect_problems(cfg)
    assert [str(p) for p in problems] == [
        "[rollout.sglang.cuda_graph_bs_decode] 'cuda_graph_bs_decode' takes a list, got 4 (SGLang 0.5.23); "
        "write rollout.sglang.cuda_graph_bs_decode as [a, b, ...]"]


# ---- from the config -------------------------------------------------------------------------------------------------

def test_adapter_sync_enables_sglangs_lora(capsys):
    """train.lora.sync=adapter: the engines start with LoRA on, sized by train.lora, in the spelling of SGLang's
    parser (the snapshot's flags; the target modules among its choices)."""
    assert main([*GPU, "rollout.num_gpus=1", "train.lora.rank=16", "train.lora.sync=adapter",
                 "train.lora.target_modules=[v_proj,q_proj]"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("--config $API_KEY_CONFIG --enable-lora --max-lora-rank 16 --lora-target-modules q_proj "
                         "v_proj --mem-fraction-static 0.7")
    specs = snapshot("sglang_server_args")["options"]
    assert [specs[k]["flags"] for k in ("enable_lora", "max_lora_rank", "lora_target_modules")] == [
        ["--enable-lora"], ["--max-lora-rank"], ["--lora-target-modules"]]
    assert specs["lora_target_modules"]["nargs"] == "*" and {"q_proj", "v_proj"} <= set(
        specs["lora_target_modules"]["choices"])
    assert main([*GPU, "rollout.num_gpus=1", "train.lora.rank=16"]) == 0  # merged sync: plain engines
    assert "lora" not in capsys.readouterr().out


def test_launch_from_config():
    cfg = to_config(compose([*GPU, "rollout.num_gpus=4", "rollout.gpus_per_engine=2", "seed=7",
                             "data.max_prompt_tokens=512", "rollout.max_response_tokens=1024",
                             "+rollout.sglang.enable_torch_compile=true"]))
    assert launch_for(cfg, derive(cfg).engine_dtype) == SGLangLaunch(model_path="/ckpt/Qwen2.5-0.5B", tp_size=2, dtype="bfloat16", seed=7,
                                           context_tokens=1536, memory_saver=False,
                                           options={"mem_fraction_static": 0.7, "enable_torch_compile": True})
    colocated = to_config(compose([*GPU, "cluster.colocate=true", "train.num_gpus=2", "train.dtype=fp32"]))
    spec = launch_for(colocated, derive(colocated).engine_dtype)
    assert (spec.dtype, spec.memory_saver, spec.tp_size) == ("float32", True, 1)


def test_cli_prints_every_engine(capsys):
    assert main([*GPU, "rollout.num_gpus=2", "rollout.gpus_per_engine=2", "data.max_prompt_tokens=64",
                 "rollout.max_response_tokens=64"]) == 0
    assert capsys.readouterr().out == (
        "# engine 0 of 1 (2 GPUs of the placement; CUDA_VISIBLE_DEVICES set from Ray)\n"
        "python -m sglang.launch_server --model-path /ckpt/Qwen2.5-0.5B --tokenizer-path /ckpt/Qwen2.5-0.5B "
        "--host $HOST --port $PORT --nccl-port $NCCL_PORT --tp-size 2 --dtype bfloat16 --random-seed 42 "
        "--context-length 128 --weight-version 0 --config $API_KEY_CONFIG --mem-fraction-static 0.7\n")
    assert main(["rollout.num_gpus=1"]) == 2
    assert "rollout.backend=embedded has no server command line to print" in capsys.readouterr().err


def test_engine_commands_quote_paths():
    cfg = to_config(compose([*GPU[:-1], "model.path=/ckpt/my model", "rollout.num_gpus=1",
                             "+rollout.sglang.chat_template='/t/my template.jinja'"]))
    (line,) = engine_commands(cfg, derive(cfg))
    assert "--model-path '/ckpt/my model' --tokenizer-path '/ckpt/my model'" in line
    assert line.endswith("--mem-fraction-static 0.7 --chat-template '/t/my template.jinja'")


# ---- the launch path, for real -------------------------------------------------------------------------------------

def test_engine_actor_runs_start_health_restart_stop(tmp_path):
    """The embedded engine through the same actor and ServerProcess the SGLang command uses."""
    model = build_model(tmp_path / "model", seed=0)
    actor = EngineActor(0, str(model), str(tmp_path / "logs"), dtype="float32", max_batch_size=4)
    try:
        url = actor.start(timeout_s=120)
        assert url == f"http://127.0.0.1:{actor.port}"
        log = (tmp_path / "logs" / "engine_0.log").read_text().splitlines()
        assert log[0] == (f"$ {sys.executable} -m slime_hydra.rollout.engines.embedded --model-path {model} "
                          f"--host 127.0.0.1 --port {actor.port} --device cpu --dtype float32 --max-batch-size 4")
        assert actor.healthy()

        async def one_generation() -> dict:
            async with SGLangClient(url) as client:
                return await client.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0},
                                             return_logprob=True)

        out = asyncio.run(one_generation())
        assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
        first_pid, port = actor.pid(), actor.port
        assert actor.restart(timeout_s=120) == url
        assert actor.port == port and actor.pid() != first_pid and actor.healthy()
        assert asyncio.run(one_generation())["output_ids"] == out["output_ids"]
    finally:
        actor.stop()
    assert not actor.alive() and not actor.healthy()


def test_sglang_actor_needs_its_gpus(tmp_path):
    actor = EngineActor(2, "/ckpt/q", str(tmp_path), sglang=launch(tp_size=2))
    with pytest.raises(RuntimeError) as info:
        actor.start()
    assert str(info.value) == ("engine 2 holds GPUs [] from its Ray placement but SGLang runs --tp-size 2 "
                               "(rollout.gpus_per_engine): the engine actor must be given exactly "
                               "rollout.gpus_per_engine GPUs")


def test_tp_engines_get_the_gpus_of_their_bundles(tmp_path):
    """Ray with 4 logical GPUs (none physical): two TP=2 engines over four one-GPU bundles, as the loop places them."""
    ray.init(num_cpus=1, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        pg = placement_group([{"GPU": 1}] * 4)
        ray.get(pg.ready(), timeout=60)
        ids = engine_gpu_ids(pg, first_bundle=0, num_engines=2, gpus_per_engine=2)
        assert [len(e) for e in ids] == [2, 2] and sorted(g for e in ids for g in e) == ["0", "1", "2", "3"]
        actor = EngineActor(1, "/ckpt/q", str(tmp_path), sglang=launch(tp_size=2), gpu_ids=ids[1])
        argv = actor.command("127.0.0.1", ids[1])
        assert argv[argv.index("--tp-size") + 1] == "2"
        assert actor._env(ids[1])["CUDA_VISIBLE_DEVICES"] == ",".join(ids[1])
    finally:
        ray.shutdown()


def test_sglang_command_through_server_process_reports_the_failure(tmp_path):
    """Here the SGLang command exits at once (no sglang package); the wrapper says so with the log tail."""
    argv = launch().command(0, "127.0.0.1", 30000, 30001)
    server = ServerProcess("engine_0", argv, "127.0.0.1", 30000, tmp_path / "engine_0.log")
    with pytest.raises(RuntimeError) as info:
        server.start().wait_healthy(timeout_s=60)
    message = str(info.value)
    assert message.startswith(f"engine_0 exited (code 1) before healthy; log {tmp_path / 'engine_0.log'}:\n$ ")
    assert message.endswith("Error while finding module specification for 'sglang.launch_server' "
                            "(ModuleNotFoundError: No module named 'sglang')\n")
    assert (tmp_path / "engine_0.log").read_text().splitlines()[0] == "$ " + " ".join(argv)


# ---- the API key -----------------------------------------------------------------------------------------------------

def test_the_key_reaches_sglang_in_a_private_config_file(tmp_path):
    """The actor starts the SGLang command (it exits here: no sglang) with --config naming a 0600 YAML file in a 0700
    directory; reading it as SGLang's --config does (yaml.safe_load, each key an option) gives --api-key <key>."""
    key = new_api_key()
    actor = EngineActor(0, "/ckpt/q", str(tmp_path / "logs"), sglang=launch(options={"mem_fraction_static": 0.7}),
                        gpu_ids=["0"])
    with pytest.raises(RuntimeError, match="No module named 'sglang'"):
        actor.start(key, timeout_s=60)
    first = (tmp_path / "logs" / "engine_0.log").read_text().splitlines()[0]
    argv = first.removeprefix("$ ").split(" ")
    config = Path(argv[argv.index("--config") + 1])
    assert argv[argv.index("--config") - 1] == "0" and argv[-2:] == ["--mem-fraction-static", "0.7"]
    assert key not in first and API_KEY_ENV not in actor._env(["0"])
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    assert config.suffix == ".yaml" and yaml.safe_load(config.read_text()) == {"api_key": key}
    actor.stop()
    assert not config.parent.exists()


@pytest.mark.parametrize("key", ["0e12", "null", "- a", "a: b # c", "'\"", "123"])
def test_the_config_file_keeps_any_key_a_string(key):
    assert yaml.safe_load(api_key_config(key)) == {"api_key": key}


def test_the_router_gets_the_key_from_its_environment(tmp_path):
    key = new_api_key()
    router = Router(log_path=tmp_path / "router.log", api_key=key, env={API_KEY_ENV: "inherited", "PATH": "/bin"})
    assert router.process.argv[1:3] == ["-m", "slime_hydra.rollout.router"] and key not in router.process.argv
    assert router.process.env == {"PATH": "/bin", API_KEY_ENV: key}
    assert API_KEY_ENV not in Router(log_path=tmp_path / "router.log", env={API_KEY_ENV: "inherited"}).process.env
