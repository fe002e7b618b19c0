"""The RL loop end to end through launch.py, as a user runs it: real Ray, router, engine process, trainer rank.

Each run is a few steps of the tiny model (random init: these tests check mechanics, not learning; the learning
run is `python launch.py` itself, recorded in README and docs/benchmarks.md).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from slime_hydra import preempt
from slime_hydra.config import PROJECT_ROOT

SHAPE = ("model.sft_warm_start_steps=0", "rollout.batch_prompts=4", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_samples=16", "reward.name=random", "tracking.progress=false")
SMALL = (*SHAPE, "rollout.eval_every_steps=0")
"""16 samples a step from the random tiny model, with random 0/1 rewards (nonzero advantages, so it trains)."""

pytestmark = pytest.mark.slow


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def train_rows(run: Path) -> list[dict]:
    return [m for m in metrics(run) if "rollout/raw_reward" in m]


def prompts_per_step(run: Path, steps: int, samples: int = 16) -> list[list[str]]:
    """The prompts each step of a run with ``debug.save_rollouts=true`` trained on, in group order (``samples`` a
    step: the run's prompts x samples per prompt)."""
    out = []
    for step in range(1, steps + 1):
        rows = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == samples
        out.append([p for _, p in sorted({s["group_index"]: s["prompt"] for s in rows}.items())])
    return out


def source_prompts(steps: int, *overrides: str) -> list[list[str]]:
    """The prompts an uninterrupted run of ``overrides`` trains on at each of its first ``steps`` steps, without
    running it: its config's training prompts handed out by a fresh PromptSource, as the rollout manager builds it
    (rollout/manager.py). An uninterrupted run's rollouts match them: the first test below checks it."""
    from slime_hydra.data.dataset import load_prompts
    from slime_hydra.data.source import PromptSource
    from slime_hydra.model.hf import load_tokenizer
    from slime_hydra.model.warm_start import resolve_model_path
    from tests.config.helpers import load

    cfg, _ = load(*overrides)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model, cfg.data, cfg.seed))
    source = PromptSource(load_prompts(cfg.data, tokenizer).records, cfg.rollout.batch_prompts,
                          shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return [[record.prompt for record in source.next_batch()] for _ in range(steps)]


def rollout_logprob_gap(model_dir: Path, rollout: Path) -> tuple[float, int]:
    """(mean |logprob| gap, tokens compared) between an HF checkpoint loaded by plain transformers and the engine's
    logprobs of every response token of a saved rollout (temperature 1, the tests' default)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for line in rollout.read_text().splitlines():
        s = json.loads(line)
        ids, n = torch.tensor([s["tokens"]]), s["response_length"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        gaps += (logp[-n:] - torch.tensor(s["rollout_log_probs"])).abs().tolist()
    return sum(gaps) / len(gaps), len(gaps)


@pytest.mark.own_ray_node
def test_default_loop_runs_syncs_checkpoints_and_exports(tmp_path, model_cache):
    """The README's `python launch.py` from a plain shell, on a Ray node of its own: without
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 exported, Ray (which reads it at import) rewrote the driver's 127.0.0.1
    address to the machine's external one and the run waited forever; launch.py sets it before ray is imported.
    Quiet (tracking.quiet=true), the run prints one line before it starts instead of the plan, which plan.txt keeps,
    and neither Ray's INFO lines nor transformers' progress bars; its provenance is on disk."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["SLIME_HYDRA_CACHE"] = model_cache
    out = subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={tmp_path}", "run_name=r",
                          "num_steps=3", "rollout.eval_every_steps=3", "tracking.quiet=true",
                          "algo.kl_loss_coef=0.001",  # the tiny tuning drops the KL term; this test checks it
                          "debug.save_rollouts=true",
                          "save_every_minutes=1e-6", "keep_checkpoints=2",  # a save after every step, two kept
                          *[a for a in SHAPE if a != "tracking.progress=false"]],  # a progress line a step on stderr
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "r"
    assert f"run directory: {run} (the config in resolved.yaml, the plan in plan.txt)" in out.stdout
    assert "Derived values" not in out.stdout and "Memory plan" not in out.stdout
    assert "Connecting to existing Ray cluster" not in out.stdout + out.stderr  # Ray's own INFO lines stay quiet
    printed = out.stdout + out.stderr + (run / "logs" / "engine_0.log").read_text()
    assert "Loading weights" not in printed and "Writing model shards" not in printed  # transformers' bars
    plan = (run / "plan.txt").read_text()
    assert "Derived values" in plan and "Memory plan (estimates" in plan and f"run directory: {run}" in plan
    resolved = yaml.safe_load((run / "resolved.yaml").read_text())
    assert resolved["algo"]["kl_loss_coef"] == 0.001 and resolved["run_name"] == "r"
    assert "algo.kl_loss_coef=0.001" in yaml.safe_load((run / "overrides.yaml").read_text())
    git = (run / "git.txt").read_text()
    assert git.startswith("sha: ") and "dirty: " in git
    assert (run / "git.diff").exists()
    versions = json.loads((run / "versions.json").read_text())
    assert versions["torch"].startswith("2.") and versions["hydra-core"] == "1.3.8"

    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]                         # steps count from 1
    first = rows[0]
    assert first["train/ppo_kl"] == 0 and first["train/pg_clipfrac"] == 0
    assert first["train/kl_loss"] == pytest.approx(0, abs=1e-7)          # the policy is the reference at step 1
    assert rows[2]["train/kl_loss"] > 0                                   # ...and moves away from it
    assert prompts_per_step(run, 3) == source_prompts(3, *SHAPE)          # the data source's order, from the top
    assert all(r["rollout/tokens"] > 0 and r["sync/bytes"] > 0 for r in rows)
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows)        # sync mode: always the newest weights
    # orchestration overhead: the step time outside the measured phases
    assert all(r["perf/overhead_time"] < 0.25 * r["perf/step_time"] for r in rows[1:])
    evals = [m for m in metrics(run) if "eval/addition/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 3]                           # before training (row 0) and after step 3
    lines = [line for line in out.stderr.splitlines() if line.startswith(("before training", "step "))]
    assert [line.split(" |")[0].rsplit(" ", 1)[0] for line in lines] == ["before training", "step 1/3", "step 2/3",
                                                                         "step 3/3"]
    assert all("generate " in line and " tok/s | step " in line for line in lines[1:])
    assert 0 <= evals[-1]["eval/addition/accuracy"] <= 1 and "eval/addition/pass@1" in evals[-1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert all(r["perf/checkpoint_time"] > 0 for r in rows)
    assert "done" in out.stdout
    assert json.loads((run / "run.json").read_text())["outcome"] == "done"

    # the trained model comes out: the final policy as an HF checkpoint with the tokenizer, and any checkpoint through
    # the export command; the policy of checkpoint 2 is the one that generated step 3's rollout, so plain
    # transformers on its export reproduces the engine's logprobs of those tokens
    final = run / "export" / "step_000003"
    assert f"the trained model: {final}" in out.stdout
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    export = subprocess.run([sys.executable, "-m", "slime_hydra.export", str(run), "--step", "2"], capture_output=True,
                            text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-4000:]
    gap, tokens = rollout_logprob_gap(run / "export" / "step_000002", run / "rollouts" / "step_000003.jsonl")
    assert tokens >= 16 and gap < 1e-5


@pytest.mark.own_ray_node
def test_a_preempted_run_resumes_exactly_and_a_finished_one_extends_on_the_new_schedule(tmp_path, shared_ray_node):
    """SIGTERM to the process group mid-run, as timeout(1), a service manager or SLURM signal a job: on a Ray node
    of its own, which runs in a session of its own (cluster/local_ray.py) and so survives until the driver has
    checkpointed, the run saves, exits 75 and records ``preempted``. The run is async with two rollouts started
    ahead of the trainer (max_staleness=2; a step trains longer than two rollouts take, so the second one ahead is
    made on weights two versions back): the checkpoint keeps them whole. The same command again (on the shared
    node) resumes from that checkpoint (resume=auto) on the learning-rate schedule of the uninterrupted run: every
    step once, on the data source's prompts in order, no sample more than 2 weight versions older than the policy
    that trains on it, and some exactly 2. Checkpoints are written in the foreground here
    (checkpoint_in_background=false); SIGKILLed runs resume in test_checkpoint_in_background.py and test_chaos.py.
    Then the finished run is extended: a longer num_steps is refused before anything starts, and allowed
    (resume_allow_changes) the rate jumps to the new schedule's."""
    args = [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={tmp_path}", "run_name=r", "num_steps=6",
            "save_every_steps=2", "debug.save_rollouts=true", "checkpoint_in_background=false", *SMALL, "mode=async",
            "max_staleness=2", "train.micro_batch_samples=1"]  # 16 micro-batches: a step outlasts two rollouts
    run = tmp_path / "r"
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while not [r for r in train_rows(run) if r["step"] >= 2]:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == preempt.EXIT_CODE == 75 and "preempted" in stdout
    assert json.loads((run / "run.json").read_text())["outcome"] == "preempted"
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 2 <= saved < 6 and [r["step"] for r in train_rows(run)] == list(range(1, saved + 1))
    ahead = json.loads((run / "checkpoints" / f"step_{saved:06d}" / "loop.json").read_text())["rollouts_ahead"]
    assert [len(batch["samples"]) for batch in ahead] == [16] * min(2, 6 - saved)  # none past the last step

    joined = {**os.environ, "RAY_ADDRESS": shared_ray_node.address}
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env=joined)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"step_{saved:06d} after step {saved}" in out.stdout  # "resumed from <run>/checkpoints/step_k after step k"
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert prompts_per_step(run, 6) == source_prompts(6, *SMALL)  # the data cursor went on exactly
    lags = [r["rollout/weight_version_lag"] for r in rows]
    assert max(lags) == 2 and lags[0] == 0, lags  # two rollouts ahead: generated on weights two versions back
    # tiny's schedule: 2e-4 decaying linearly to 2e-5 over the 6 steps (one optimizer step each), logged as train/lr
    # by the preempted run up to its checkpoint and by the resumed one after it, as an uninterrupted run logs it
    assert [r["train/lr"] for r in train_rows(run)] == pytest.approx([2e-4, 1.7e-4, 1.4e-4, 1.1e-4, 8e-5, 5e-5],
                                                                     rel=1e-9)

    longer = [a for a in args if a != "num_steps=6"] + ["num_steps=8", "train.lr=1e-4"]
    refused = subprocess.run(longer, capture_output=True, text=True, timeout=120, env=joined)
    assert refused.returncode == 2 and "  train.lr: 0.0002 -> 0.0001\n  num_steps: 6 -> 8\n" in refused.stderr
    out = subprocess.run([*longer, "resume_allow_changes=true"], capture_output=True, text=True, timeout=300,
                         env=joined)
    assert out.returncode == 0, out.stderr[-4000:]
    # after 6 optimizer steps of 6 the rate was 2e-5; of 8 at a 1e-4 peak, steps 7 and 8 run at 2e-5 + 8e-5 x 2/8
    # and 2e-5 + 8e-5 x 1/8
    assert "the learning rate at step 7: 2e-05 -> 4e-05" in out.stdout
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["train/lr"] for r in rows[6:]] == pytest.approx([4e-5, 3e-5], rel=1e-9)
    # every launch that ran kept its config (the refused one ran nothing); the top level is the latest
    launches = sorted((run / "launches").iterdir())
    assert [yaml.safe_load((p / "resolved.yaml").read_text())["num_steps"] for p in launches] == [6, 6, 8]
    assert (run / "resolved.yaml").read_text() == (launches[-1] / "resolved.yaml").read_text()


def test_rollout_only_then_train_only_from_the_saved_rollouts(tmp_path):
    """The train-only run is PPO's, so the loop's critic path (values, GAE, the critic's steps) runs end to end."""
    out = launch(f"output_dir={tmp_path}", "run_name=gen", "num_steps=2", "debug=rollout_only", *SMALL)
    assert out.returncode == 0, out.stderr[-4000:]
    saved = sorted((tmp_path / "gen" / "rollouts").glob("step_*.jsonl"))
    assert len(saved) == 2
    assert all("train/pg_loss" not in r for r in train_rows(tmp_path / "gen"))
    out = launch(f"output_dir={tmp_path}", "run_name=train", "num_steps=2", "debug=train_only",
                 f"debug.rollout_path={tmp_path / 'gen' / 'rollouts'}", *SMALL, "algo=ppo")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [m for m in metrics(tmp_path / "train") if "train/pg_loss" in m]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/value_loss"] > 0 and r["train/critic_grad_norm"] > 0 for r in rows)  # the critic trained
    assert not (tmp_path / "train" / "logs" / "engine_0.log").exists()    # no engine was started
