"""Checkpoints written in the background (checkpoint_in_background=true, the default) through launch.py, as a user runs
it: real Ray, router, engine, trainer rank. ``latest`` only ever names a checkpoint whose files are all on disk (a
run killed while a write is held resumes from the checkpoint before it), and a run resumes from it exactly: every
step logged once, each step trained on the prompts of an uninterrupted run. Runs SIGKILLed at random moments resume
in test_chaos.py.

The run is deterministic (deterministic=true) and truly on-policy (algo.true_on_policy=true): the steps the resumed
launch trains again repeat the killed launch's metrics bit for bit (times and speeds aside), and every step's
train/rollout logprob mismatch is 0.0."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_hydra.config import PROJECT_ROOT
from slime_hydra.train.checkpoint_writer import HOLD_ENV
from tests.loop.test_loop import SMALL, prompts_per_step, source_prompts, train_rows

pytestmark = pytest.mark.slow

STEPS = 6


def _command(output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={output_dir}", "run_name=r",
            f"num_steps={STEPS}", "debug.save_rollouts=true", "deterministic=true", "algo.true_on_policy=true", *SMALL,
            *overrides]


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, int, str, int, list[dict]]:
    """A run that saves after every step in the background, with the write of checkpoint 4's trainer files held (the
    writer waits on a file, HOLD_ENV): it trains step 5 meanwhile and then waits at step 5's save, for that write.
    SIGKILLed (its process group) there, ``latest`` still names checkpoint 3, checkpoint 4's folder has the loop's
    files but not the trainer's. Then checkpoint 3's trainer shard is cut in half, and the same command runs again to
    its end: it must pass over both. Its run directory, the step it resumed after, its output, the shard's size and
    the killed launch's step rows.

    The run starts its own Ray node (this fixture is set up before the loop tests' shared-node environment), which
    is what lets HOLD_ENV reach the trainer rank through the environment."""
    out_dir = tmp_path_factory.mktemp("resumed")
    command, run = _command(out_dir, "save_every_steps=1"), out_dir / "r"
    held = run / "checkpoints" / "step_000004"
    log = out_dir / "held_run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, HOLD_ENV: str(held)})
    try:
        deadline = time.monotonic() + 300
        while not (list(held.glob("held_*")) and [r for r in train_rows(run) if r["step"] == 4]):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no write held and step 4 trained within 300 s"
            time.sleep(0.05)
        time.sleep(1.0)  # step 5 trains and its save waits for the held write: the run ends no further
        assert proc.poll() is None and _latest(run) == "step_000003"
        assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _latest(run) == "step_000003"
    killed = train_rows(run)
    assert json.loads((held / "loop.json").read_text())["step"] == 4 and (held / "rollout.json").exists()
    assert not (held / "actor" / "rank0.pt").exists() and not (held / "actor" / "trainer.json").exists()
    shard = run / "checkpoints" / "step_000003" / "actor" / "dcp" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (held / "actor" / "trainer.json").exists()  # written again, whole
    after = int(out.stdout.split(" after step ", 1)[1].split()[0])  # "resumed from <checkpoint> after step k"
    return run, after, out.stdout, size, killed


def _repeatable(row: dict) -> dict:
    """A metrics row without its times, speeds and memory peaks (``time``, ``perf/*``, ``*_gb``: an engine's peak
    depends on how many requests it ran at once, which timing decides)."""
    return {k: v for k, v in row.items() if k != "time" and not k.startswith("perf/") and not k.endswith("_gb")}


def test_saves_after_every_step_in_the_background_and_a_run_killed_with_a_write_held_resumes_exactly(resumed):
    run, after, _, _, killed = resumed
    assert after == 2  # checkpoint 4's write was held when the run was killed, and 3 is damaged (below)
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert prompts_per_step(run, STEPS) == source_prompts(STEPS, *SMALL)  # the data source's order, from the top
    # deterministic: steps 3 and 4, trained by both launches, drew the same samples and trained alike
    assert [_repeatable(r) for r in rows[after:4]] == [_repeatable(r) for r in killed[after:4]]
    assert [r["train/train_rollout_logprob_abs_diff_max"] for r in rows] == [0.0] * STEPS  # truly on-policy
    # the write started after step k is seen finished at the next step's boundary (the last one waits for it); the
    # first step of each launch has none to see
    for r in rows:
        if r["step"] in (1, after + 1):
            assert "perf/checkpoint_write_time" not in r
        else:
            assert r["perf/checkpoint_write_time"] > 0 and r["perf/checkpoint_time"] > 0
    assert _latest(run) == "step_000006"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_000004", "step_000005", "step_000006"]  # keep_checkpoints=3


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one(resumed):
    """The resumed run above: ``latest`` named checkpoint 3, whose trainer shard was cut in half; the command resumed
    from the one before, said why, set the damaged one aside (with checkpoint 4's unfinished save) and trained on
    exactly as an uninterrupted run does."""
    run, _, stdout, size, _ = resumed
    assert (f"resuming from step_000002: {run}/checkpoints/step_000003 is damaged (actor/dcp/__0_0.distcp: "
            f"{size // 2} bytes, manifest says {size})") in stdout
    assert "step_000002 after step 2" in stdout  # "resumed from <run>/checkpoints/step_000002 after step 2"
    # set aside before the first save: the damaged checkpoint and the unfinished save of step 4
    assert sorted(p.name.split("-")[0] for p in (run / "checkpoints" / "partial").iterdir()) == [
        "step_000003", "step_000004"]
