"""An engine killed with SIGKILL in the middle of a run, through launch.py: the run finishes every step with the same
samples per step, on every CPU weight-sync path.

The kill happens once step 1 is in metrics.jsonl, so the engine already holds synced weights (version >= 2) that
the initial checkpoint it restarts from does not have: with ``distributed`` (the CPU default: a gloo broadcast)
nothing on the rollout side can replay them, so the restarted engine waits for weights and the loop has the
trainer send them again (unless the step's own sync reaches it first: the kill may land in any phase of step 2);
with ``tensor`` (colocated on CPU) the rollout manager replays its kept copy; with ``disk`` the engine reloads the
newest export; with CUDA IPC (``tensor`` colocated on a GPU: the ``cuda_ipc`` case, run on the GPU machine with
``-m gpu``) nothing on the rollout side can replay them either, and it recovers the way ``distributed`` does.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from slime_hydra.config import PROJECT_ROOT
from tests.loop.test_loop import SMALL, train_rows

pytestmark = pytest.mark.slow


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    try:
        return [root] + [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return [root]


def run_processes(driver: int, node, since: float = 0.0) -> list[int]:
    """The processes of a run: the driver and its children, and the processes of the shared Ray node ``node``
    (tests/conftest.py; None for a run on its own node, which is the driver's child) started at ``since`` (epoch
    seconds) or later: Ray's workers and what they started. Ray ends the workers of a killed driver within seconds,
    so ``since`` keeps those of an earlier run out."""
    pids = descendants(driver) + ([p for p in descendants(node.proc.pid)[1:] if _started(p) >= since] if node else [])
    return list(dict.fromkeys(pids))


def _started(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return float("inf")


def engine_pids(pids: list[int]) -> list[int]:
    return [p for p in pids if "slime_hydra.rollout.engines.embedded" in cmdline(p)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


ON_ONE_GPU = ("cluster.gpus_per_node=1", "train.num_gpus=1", "cluster.colocate=true", "rollout.num_gpus=null")
"""Trainer and engine colocated on one GPU: weight_sync=tensor is the CUDA IPC path."""


@pytest.mark.parametrize("weight_sync, engines, placement", [
    ("distributed", 1, ("rollout.num_gpus=1",)), ("tensor", 1, ("cluster.colocate=true",)),
    ("disk", 1, ("rollout.num_gpus=1",)), ("distributed", 2, ("rollout.num_gpus=2",)),
    pytest.param("tensor", 1, ON_ONE_GPU, id="cuda_ipc", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_an_engine_killed_mid_run_costs_nothing(tmp_path, joined_ray, weight_sync, engines, placement):
    args = [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={tmp_path}", "run_name=r", "num_steps=5",
            f"train.weight_sync={weight_sync}", *placement, "debug.save_rollouts=true",
            "rollout.health_check_interval_s=0.5", *SMALL]
    run = tmp_path / "r"
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not [r for r in train_rows(run) if r["step"] >= 2]:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.1)
        pids = engine_pids(run_processes(proc.pid, joined_ray))
        assert len(pids) == engines
        os.kill(pids[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1
    resends = sum(r["rollout/weight_resends"] for r in rows)
    # distributed or CUDA IPC, one engine: the trainer sends the weights again unless the step's own sync reached the
    # restarted engine first; with two, the other engine serves until the step's sync brings the restarted one back
    replayable = weight_sync == "disk" or (weight_sync == "tensor" and placement != ON_ONE_GPU)
    assert resends == 0 if replayable or engines == 2 else resends <= 1
    assert ("sending version" in out) == (resends == 1)
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows)  # no step trained on stale or initial weights
    prompts = []
    for step in range(1, 6):
        samples = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 16 and len({s["index"] for s in samples}) == 16
        assert all(s["weight_version"] == step - 1 for s in samples)  # step k samples with the weights of k - 1
        prompts += {s["group_index"]: s["prompt"] for s in samples}.values()
    assert len(prompts) == 20 and len(set(prompts)) == 20  # every step 4 new prompts, none lost or repeated


@pytest.mark.own_ray_node
def test_nothing_of_a_run_outlives_its_driver_killed_with_sigkill(tmp_path):
    """kill -9 of the driver alone (not its process group): the trainer rank, the rollout manager, the engine, the
    router and Ray's daemons and agents end within 30 s."""
    args = [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={tmp_path}", "run_name=r", "num_steps=50",
            *SMALL]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not train_rows(tmp_path / "r"):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 1"
            time.sleep(0.1)
        run = [p for p in descendants(proc.pid) if p != proc.pid]
        assert engine_pids(run) and len(run) >= 5  # Ray's daemons, the actors, the engine, the router
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while alive := [p for p in run if _state(p) != "Z"]:
            assert time.monotonic() < killed + 30, f"alive 30 s after the driver died: {_names(alive)}"
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _state(pid: int) -> str:
    """The process's state letter; "Z" also for one that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _names(pids: list[int]) -> list[str]:
    return [f"{pid} {cmdline(pid)[:80]}" for pid in pids]
