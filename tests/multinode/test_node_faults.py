"""Node faults on the two-node cluster: a node that never joins is named, a node that dies mid-run stops the run
within seconds naming the node and what ran there, no job is left holding nodes, and the same command resumes."""

import json
import re
import signal
import subprocess
import time

import pytest

from tests.loop.test_engine_crash import cmdline
from tests.multinode.conftest import FABRIC, wait_until
from tests.multinode.test_two_nodes import SMALL, job_log, trained_rows, trained_steps

pytestmark = [pytest.mark.multinode, pytest.mark.usefixtures("two_nodes")]

RAY_PORTS = "7168-8191"
"""cluster.ray_port=7168: the head's GCS port is 7168 + job id % 1000, inside this range, which ``partition`` closes."""


def partition(two_nodes, node: str, on: bool) -> None:
    """Refuse (on) or allow again (off) every connection node opens to a port in RAY_PORTS: a firewall between node
    and the Ray head (a routing rule in node's namespace; SLURM's own traffic passes)."""
    out = two_nodes.on(node, "ip", "rule", "add" if on else "del", "dport", RAY_PORTS, "prohibit")
    assert out.returncode == 0 or not on, out.stderr


def job_processes(two_nodes, node: str, job_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of the job's Ray processes on node (their temp dir names the job)."""
    pids = subprocess.run(["ip", "netns", "pids", f"mn_{node}"], capture_output=True, text=True).stdout.split()
    return [(int(p), cmdline(int(p))) for p in pids if f"/tmp/ray_{job_id}" in cmdline(int(p))]


def engine_servers(node: str) -> list[int]:
    """pids of the embedded engine servers running on node (one run at a time on the cluster)."""
    pids = subprocess.run(["ip", "netns", "pids", f"mn_{node}"], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in pids if "slime_hydra.rollout.engines.embedded" in cmdline(int(p)))


def test_a_node_that_never_joins_is_named_when_the_wait_ends(two_nodes, tmp_path):
    run_dir = tmp_path / "lone"
    partition(two_nodes, "mnode2", True)
    try:
        start = time.monotonic()
        out = two_nodes.launch(*SMALL, "num_steps=2", "cluster.ray_port=7168", "cluster.ray_wait_nodes_s=20",
                               "run_name=lone", f"output_dir={tmp_path}")
        assert out.returncode == 0, out.stderr
        end = two_nodes.wait_for_end(run_dir, 300)
        took = time.monotonic() - start
    finally:
        partition(two_nodes, "mnode2", False)
    assert end["state"] == "FAILED", end
    assert "mnode2" in end["reason"] and "cluster.ray_wait_nodes_s=20" in end["reason"], end["reason"]
    assert took < 20 + 120, took  # the wait's bound, plus the job's start and end on a busy machine
    assert not trained_steps(run_dir)


def test_a_node_that_dies_mid_run_is_named_frees_the_allocation_and_the_same_command_resumes(two_nodes, tmp_path):
    """One run (weight_sync=disk, the other method that crosses nodes: the shared filesystem), two faults:
    - node 2's engine server is SIGKILLed after step 2: it restarts on node 2 (node 1's engine never stops), reloads
      the newest weights, and no sample is lost or repeated;
    - once a step's metrics count the restart, node 2's raylet is SIGKILLed: the job stops within seconds naming the
      node and what ran there, no process of the job is left on either node, and the same command resumes and
      finishes.
    Every step has its 16 samples of 4 new prompts, all drawn with the weights of the step before."""
    run_dir = tmp_path / "dies"
    command = (*SMALL, "num_steps=10", "save_every_steps=2", "cluster.ray_port=7168", "train.weight_sync=disk",
               "debug.save_rollouts=true", "rollout.health_check_interval_s=0.5", "run_name=dies",
               f"output_dir={tmp_path}")
    out = two_nodes.launch(*command)
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    wait_until(lambda: len(trained_steps(run_dir)) >= 2, 900, "step 2", poll_s=1)

    before = {node: engine_servers(node) for node in ("mnode1", "mnode2")}
    assert len(before["mnode1"]) == 1 and len(before["mnode2"]) == 1, before
    subprocess.run(["kill", "-9", str(before["mnode2"][0])], check=True)
    again = wait_until(lambda: [p for p in engine_servers("mnode2") if p != before["mnode2"][0]], 300,
                       "engine 1 to restart on node 2")
    assert len(again) == 1 and engine_servers("mnode1") == before["mnode1"]  # node 1's engine never stopped
    assert wait_until(lambda: re.search(rf"engine 1 \(http://{re.escape(FABRIC['mnode2'])}:\d+\) is down: "
                                        ".*restarting it", job_log(run_dir)), 60, "the restart in the job's log")
    # the restart is counted (once it is found) in the next batch reported: the rollout under way, or the next
    wait_until(lambda: sum(r["rollout/engine_restarts"] for r in trained_rows(run_dir)) == 1, 300,
               "the restart counted in a step's rollout metrics", poll_s=0.2)
    assert len(trained_rows(run_dir)) < 8, "the run ended before node 2's raylet was killed"

    raylet = [pid for pid, cmd in job_processes(two_nodes, "mnode2", job_id) if "raylet" in cmd.split()[0]]
    assert len(raylet) == 1, job_processes(two_nodes, "mnode2", job_id)
    killed = time.monotonic()
    subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(raylet[0])], check=True)
    end = two_nodes.wait_for_end(run_dir, 300)
    stopped_s = time.monotonic() - killed
    assert end["state"] == "FAILED", end
    assert f"lost node 2 mnode2 ({FABRIC['mnode2']}): train rank 1, engine 1" in end["reason"], end["reason"]
    assert stopped_s < 120, stopped_s  # Ray notices within seconds; the rest is the job's teardown on a busy machine
    assert not job_processes(two_nodes, "mnode1", job_id) and not job_processes(two_nodes, "mnode2", job_id)
    print(f"node 2's raylet killed: the job ended {stopped_s:.1f} s later")

    again = two_nodes.launch(*command)
    assert again.returncode == 0, again.stderr
    end = two_nodes.wait_for_end(run_dir, 900)
    assert end["state"] == "COMPLETED", end
    assert trained_steps(run_dir) == list(range(1, 11))
    assert "resumed from" in job_log(run_dir)
    rows = trained_rows(run_dir)
    assert all(r["rollout/weight_version_lag"] == 0 for r in rows), rows
    prompts = []
    for step in range(1, 11):
        saved = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text()
        samples = [json.loads(line) for line in saved.splitlines()]
        assert len(samples) == 16 and len({s["index"] for s in samples}) == 16
        assert all(s["weight_version"] == step - 1 for s in samples)  # step k samples with the weights of k - 1
        prompts += {s["group_index"]: s["prompt"] for s in samples}.values()
    assert len(prompts) == 40 and len(set(prompts)) == 40
