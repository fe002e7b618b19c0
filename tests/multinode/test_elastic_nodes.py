"""Engines that follow the cluster's nodes (rollout.elastic=true) on the two-node cluster: a run allocated one node;
node 2 joins its Ray cluster mid-run (``ray start --address`` with the job's token, as a second allocation would) and
gets an engine, which takes the newest weights by broadcast across the nodes and serves; then node 2's raylet is
SIGKILLed: its engine is dropped and the run goes on with node 1's to its end. Every step once, 16 samples of 4 new
prompts each, all sampled with the weights of the step before."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slime_hydra.cluster.ray_cluster import ray_process_env
from slime_hydra.net import free_port
from tests.multinode.conftest import FABRIC, wait_until
from tests.multinode.test_node_faults import job_processes
from tests.multinode.test_two_nodes import SMALL, job_log, trained_rows, trained_steps

pytestmark = [pytest.mark.multinode, pytest.mark.usefixtures("two_nodes")]

STEPS = 12
ONE_NODE = (*[o for o in SMALL if not o.startswith(("train.num_gpus", "rollout.num_gpus"))], "train.num_gpus=1",
            "rollout.num_gpus=1", "cluster.nodes=1")
"""SMALL on one node: one trainer rank, one engine."""


def layouts(run_dir: Path) -> list[int]:
    """Each trained step's engines in service when its rollout began (rollout/engines_in_service)."""
    return [int(row["rollout/engines_in_service"]) for row in trained_rows(run_dir)]


def manager_said(job_id: str, text: str) -> bool:
    """The rollout manager printed ``text`` (its Ray worker log on the head; the driver, stopped, forwards nothing)."""
    return any(text in path.read_text(errors="replace")
               for path in Path(f"/tmp/ray_{job_id}/session_latest/logs").glob("worker-*.out"))


def test_a_node_that_joins_gets_an_engine_and_one_that_leaves_takes_it_away(two_nodes, tmp_path):
    """The driver is SIGSTOPped while node 2 joins and while it leaves: the rollout manager (another process) follows
    the nodes meanwhile, and the steps after each change are still to come."""
    run_dir = tmp_path / "elastic"
    out = two_nodes.launch(*ONE_NODE, f"num_steps={STEPS}", "rollout.elastic=true", "cluster.ray_port=7168",
                           "debug.save_rollouts=true", "rollout.health_check_interval_s=0.5", "run_name=elastic",
                           f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    job = json.loads((run_dir / "job.json").read_text())
    job_id = job["job_id"]
    try:
        wait_until(lambda: len(trained_steps(run_dir)) >= 1, 600, "step 1 on node 1", poll_s=0.2)
        driver = json.loads((run_dir / "run.json").read_text())["pid"]
        os.kill(driver, signal.SIGSTOP)
        stopped_at = len(trained_steps(run_dir))
        assert f"node 1 mnode1 ({FABRIC['mnode1']}): driver, rollout manager, router, train rank 0, engine 0" in \
            job_log(run_dir)
        head = f"{FABRIC['mnode1']}:{7168 + int(job_id) % 1000}"
        joined = two_nodes.on("mnode2", sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={head}",
                              f"--node-ip-address={FABRIC['mnode2']}", f"--temp-dir=/tmp/ray_{job_id}_joined",
                              "--num-cpus=2", "--num-gpus=0", "--disable-usage-stats",
                              f"--dashboard-agent-listen-port={free_port('')}",
                              env=ray_process_env(Path(job["submitit_folder"])))
        assert joined.returncode == 0, joined.stdout + joined.stderr
        wait_until(lambda: manager_said(job_id, "engine 1 (http://" + FABRIC["mnode2"]), 300,
                   "engine 1 started on node 2")  # out of the router until the next broadcast reaches it
        os.kill(driver, signal.SIGCONT)
        wait_until(lambda: manager_said(job_id, "(a weight sync reached it)"), 300, "engine 1 in service")
        wait_until(lambda: 2 in layouts(run_dir), 300, "a step begun with both engines", poll_s=0.2)

        os.kill(driver, signal.SIGSTOP)
        left_at = len(trained_steps(run_dir))
        raylet = [pid for pid, cmd in job_processes(two_nodes, "mnode2", job_id) if "raylet" in cmd.split()[0]]
        assert len(raylet) == 1, job_processes(two_nodes, "mnode2", job_id)
        subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(raylet[0])], check=True)
        wait_until(lambda: manager_said(job_id, "left the cluster"), 300, "engine 1 dropped")
        os.kill(driver, signal.SIGCONT)
        end = two_nodes.wait_for_end(run_dir, 900)
    finally:
        for pid, _ in job_processes(two_nodes, "mnode2", job_id):
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
        shutil.rmtree(f"/tmp/ray_{job_id}_joined", ignore_errors=True)  # job ids start again at 1 in tests/slurm
    assert end["state"] == "COMPLETED", end
    assert stopped_at < left_at < STEPS
    # steps ran with each layout, in order: one engine, two, one again (consecutive repeats merged)
    assert [n for i, n in enumerate(layouts(run_dir)) if i == 0 or n != layouts(run_dir)[i - 1]] == [1, 2, 1]
    log = job_log(run_dir)
    assert f"node {FABRIC['mnode2']} joined the cluster: starting 1 engine(s) on it" in log
    assert re.search(rf"engine 1 \(http://{re.escape(FABRIC['mnode2'])}:\d+\) dropped: removed: its node "
                     rf"{re.escape(FABRIC['mnode2'])} left the cluster", log), log[-4000:]
    rows = trained_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows)  # the added engine never served old weights
    assert sum(r["rollout/engine_restarts"] for r in rows) == 0  # dropped with its node, however found: no restart
    prompts = []
    for step in range(1, STEPS + 1):
        saved = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text()
        samples = [json.loads(line) for line in saved.splitlines()]
        assert len(samples) == 16 and len({s["index"] for s in samples}) == 16
        assert all(s["weight_version"] == step - 1 for s in samples)  # step k samples with the weights of k - 1
        prompts += {s["group_index"]: s["prompt"] for s in samples}.values()
    assert len(prompts) == 4 * STEPS and len(set(prompts)) == 4 * STEPS  # 4 new prompts a step, none repeated
