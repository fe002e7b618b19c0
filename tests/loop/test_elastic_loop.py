"""Engines added and removed by command while a run goes on (``python -m slime_hydra.engines``), through
launch.py: real Ray, router, engine processes, trainer rank, weights synced by broadcast (the CPU default). The
added engine waits out of the router for the next sync, which forms the broadcast group again with it, then
serves; engine 0 is then drained and removed, and the run goes on on engine 1 alone until SIGTERM stops it (the
run is long: the requests are served between steps whenever they come): every step once, 16 samples of 4 new
prompts each, all sampled with the newest weights, no engine restarted. The manager's side (replayed weights, a
removal mid-batch) is tests/rollout/test_elastic.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slime_hydra import preempt
from slime_hydra.config import PROJECT_ROOT
from tests.loop.test_loop import SMALL, train_rows

pytestmark = pytest.mark.slow


def engines(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_hydra.engines", *args], capture_output=True, text=True,
                          timeout=300)


def _wait_for_step(run, step: int, proc) -> None:
    deadline = time.monotonic() + 240
    while not [r for r in train_rows(run) if r["step"] >= step]:
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before step {step}"
        time.sleep(0.1)


def test_an_engine_added_then_one_removed_by_command_mid_run_loses_and_repeats_nothing(tmp_path):
    run = tmp_path / "r"
    args = [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={tmp_path}", "run_name=r", "num_steps=200",
            "debug.save_rollouts=true", "rollout.health_check_interval_s=0.5", *SMALL]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_step(run, 1, proc)
        added = engines("add", str(run))
        assert added.returncode == 0, added.stdout + added.stderr
        assert added.stdout.startswith("added: engine 1 (http://127.0.0.1:")  # broadcast: in after the next sync
        assert "out of service: joined; waits for the next weight sync, not in the router" in added.stdout
        joined = max(r["step"] for r in train_rows(run))
        _wait_for_step(run, joined + 2, proc)  # the sync after step joined + 1 brought it in
        listed = engines("list", str(run))
        assert listed.returncode == 0 and listed.stdout.count("in service, in the router") == 2, listed.stdout

        removed = engines("remove", str(run), "0")
        assert removed.returncode == 0, removed.stdout + removed.stderr
        assert removed.stdout.startswith("removed: engine 0 (") and "out of service: removed" in removed.stdout
        refused = engines("remove", str(run), "1")
        assert refused.returncode == 1 and "refused: engine 1 is the last engine in service" in refused.stderr
        _wait_for_step(run, max(r["step"] for r in train_rows(run)) + 2, proc)  # engine 1 alone serves steps
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == preempt.EXIT_CODE, out[-4000:]
    rows = train_rows(run)
    steps = len(rows)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and steps >= joined + 4
    assert sum(r["rollout/engine_restarts"] for r in rows) == 0
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows)  # the added engine never served old weights
    prompts = []
    for step in range(1, steps + 1):
        samples = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 16 and len({s["index"] for s in samples}) == 16
        assert all(s["weight_version"] == step - 1 for s in samples)
        prompts += {s["group_index"]: s["prompt"] for s in samples}.values()
    assert len(prompts) == 4 * steps and len(set(prompts)) == 4 * steps  # every step 4 new prompts, none repeated
    assert out.count("loop: engine request ") == 4 and "engine 1 (http://127.0.0.1:" in out
    assert not list((run / "engine_requests").glob("*.request.json"))  # each answered
