"""launch.py end to end, as a user runs it: dry runs, --cfg, exit codes, sweeps (a real run from a plain shell, its
provenance on disk: tests/loop/test_loop.py's default run)."""

import json
import subprocess
import sys

import pytest
import yaml

from slime_hydra.config import PROJECT_ROOT
from slime_hydra.config.derive import bundle_nodes, node_roles
from slime_hydra.model.tiny import build_tiny_tokenizer
from tests.config.helpers import load


def launch(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_dry_run_prints_config_derived_values_and_plan_and_starts_nothing(tmp_path):
    out = launch("dry_run=true", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    for expected in ("Resolved config", "samples per rollout", "256", "placement group 'train'",
                     "placement group 'rollout'", "dry run: config valid, nothing started."):
        assert expected in out.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_cfg_job_prints_the_composed_config():
    out = launch("--cfg", "job", "algo=dr_grpo")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["algo"]["name"] == "dr_grpo" and cfg["algo"]["std_normalization"] is False
    assert cfg["model"]["name"] == "tiny"


def test_typo_exits_2_with_nearest_name_before_composition():
    out = launch("rollout.temprature=0.7")
    assert out.returncode == 2
    assert "did you mean 'rollout.temperature'" in out.stderr
    assert "Traceback" not in out.stderr


def test_invalid_config_exits_2_listing_every_problem(tmp_path):
    out = launch("rollout.n_samples_per_prompt=1", "algo.kl_loss_coef=0.001", "algo.kl_coef=0.1",
                 f"output_dir={tmp_path}")
    assert out.returncode == 2
    assert "3 config problems" in out.stderr  # n=1 also leaves 32 samples for a 64-sample micro-batch
    assert "rollout.n_samples_per_prompt" in out.stderr and "mutually exclusive" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_slurm_dry_run_renders_sbatch_with_derived_nodes():
    out = launch("model=qwen3_8b", "model.path=/ckpt", "cluster=slurm_8xh100", "train=megatron", "train.num_gpus=16",
                 "train.tp=4", "rollout=sglang", "rollout.num_gpus=8", "rollout.gpus_per_engine=2", "dry_run=true")
    assert out.returncode == 0, out.stderr
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=rl-research", "#SBATCH --signal=USR1@300", "module load cuda/12.4"):
        assert line in out.stdout
    assert "GPU-hours reserved" in out.stdout and "576.0" in out.stdout  # 3 nodes x 8 GPUs x 24 h


def test_sweep_dry_run_validates_every_point(tmp_path):
    out = launch("-m", "sweeps=kl_x_lr", "dry_run=true", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("dry run: config valid, nothing started.") == 6
    assert "algo.kl_loss_coef=0.01 train.lr=0.0001" in out.stdout + out.stderr


def test_checkpoint_architecture_must_match_the_model_option(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
                                                  "num_key_value_heads": 2, "intermediate_size": 4864,
                                                  "vocab_size": 151936, "max_position_embeddings": 32768}))
    (ckpt / "model.safetensors").write_bytes(b"")  # the files check looks for weights and a tokenizer that loads
    build_tiny_tokenizer().save_pretrained(ckpt)
    gpu = ("cluster.gpus_per_node=2", "cluster.gpu_memory_gb=80", "rollout.max_response_tokens=512")
    ok = launch("model=qwen2_5_0_5b", f"model.path={ckpt}", f"output_dir={tmp_path}", "dry_run=true", *gpu)
    assert ok.returncode == 0 and "config.json" not in ok.stderr, ok.stderr
    wrong = launch("model=qwen3_0_6b", f"model.path={ckpt}", f"output_dir={tmp_path}", "run_name=bad", *gpu)
    assert wrong.returncode == 2
    assert "model.num_layers" in wrong.stderr and "config.json says 24" in wrong.stderr


def test_missing_files_warn_in_slurm_dry_runs_and_refuse_everywhere_else(tmp_path):
    """A SLURM recipe's paths may exist only on the cluster's shared storage; a local run's are all here."""
    args = ("data=jsonl", f"data.path={tmp_path}/nope.jsonl", "data.max_prompt_tokens=64", f"output_dir={tmp_path}")
    slurm = launch(*args, "dry_run=true", "cluster=slurm", "cluster.gpu_memory_gb=80")
    assert slurm.returncode == 0 and "warning: [data.path]" in slurm.stderr, slurm.stderr
    for local in (launch(*args, "dry_run=true"), launch(*args)):
        assert local.returncode == 2 and "nope.jsonl does not exist" in local.stderr, local.stderr


@pytest.mark.parametrize("args,key", [
    (("model=qwen3_9b",), "[model] 'qwen3_9b' is not an option of group model"),
    (("algo=grpp",), "did you mean algo=grpo?"),
    (("rollout.batch_prompts=abc",), "[rollout.batch_prompts] Value 'abc'"),
    (("train.lr=1e-3e",), "set train.lr to a number"),
    (("cluster.colocate=maybe",), "set cluster.colocate=true or cluster.colocate=false"),
    (("model.num_layers=null",), "[model.num_layers]"),
    (("run_name=a;b",), "[run_name] cannot parse the override"),
    (("rollout.generate",), "[rollout.generate] the override 'rollout.generate' has no value"),
    (("train=megatron", "train.tp=2"), "[train.num_gpus, train.tp, train.pp, train.cp]"),
])
def test_hydra_and_omegaconf_errors_exit_2_in_our_format(args, key):
    out = launch(*args, "dry_run=true")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("slime_hydra: 1 config problem:") and key in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr


def test_the_layout_spreads_cpu_processes_round_robin_and_fills_gpu_nodes_in_order():
    cfg, d = load("cluster=ci_two_node", "train.num_gpus=2", "rollout.num_gpus=2")
    assert (d.nodes, bundle_nodes(cfg, d)) == (2, [0, 1, 0, 1])
    assert node_roles(cfg, d) == [["train rank 0", "engine 0"], ["train rank 1", "engine 1"]]
    cfg, d = load("cluster=ci_two_node")  # one rank and one engine: one on each node
    assert node_roles(cfg, d) == [["train rank 0"], ["engine 0"]]
    cfg, d = load("model=qwen3_8b", "model.path=/ckpt", "cluster=slurm_8xh100", "train=megatron", "train.num_gpus=16",
                  "train.tp=4", "rollout=sglang", "rollout.num_gpus=8", "rollout.gpus_per_engine=2")
    assert bundle_nodes(cfg, d) == [0] * 8 + [1] * 8 + [2] * 8
    roles = node_roles(cfg, d)
    assert roles[1] == [f"train rank {r}" for r in range(8, 16)] and roles[2] == [f"engine {e}" for e in range(4)]


def test_help_describes_each_option_by_its_whole_first_sentence():
    """YAML comments and docstrings wrap mid-sentence: --help joins the lines and stops at the first sentence end, not
    at an abbreviation's dot."""
    from slime_hydra.config import PROJECT_ROOT
    from slime_hydra.launch.help import first_sentence, render_help

    assert first_sentence("Dr. GRPO (a, b): no std\n  normalisation, e.g. here. More text.") == (
        "Dr. GRPO (a, b): no std normalisation, e.g. here.")
    assert first_sentence("no end at all") == "no end at all"
    help_lines = render_help(PROJECT_ROOT).splitlines()

    def described(option: str) -> str:
        return next(line for line in help_lines if f" {option} " in line)

    assert "Dr. GRPO (Understanding R1-Zero-Like Training): no std normalisation, and token sums divided by a constant" \
        in described("dr_grpo")
    assert described("tiny_moe").endswith("built offline and cached like tiny.")  # three comment lines, joined
