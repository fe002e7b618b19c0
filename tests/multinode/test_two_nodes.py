"""The real loop on two nodes (.ci/multinode_up.sh): submitit allocates both, the Ray head on node 1 and a worker on
node 2, trainer rank i and engine i on node i, weights broadcast across, auth on every control plane, and the
faults a cluster has: the time-limit signal, a node that dies, a node that never joins."""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.multinode.conftest import FABRIC, SITE, wait_until

pytestmark = [pytest.mark.multinode, pytest.mark.usefixtures("two_nodes")]

SMALL = ("train.num_gpus=2", "rollout.num_gpus=2", "rollout.batch_prompts=4", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_samples=4", "rollout.eval_every_steps=0", "tracking.progress=false",
         "stall_after_minutes=0")
"""The tiny default with a smaller batch: DP 2 over gloo (one rank per node) and one engine per node."""


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def trained_rows(run_dir: Path) -> list[dict]:
    return [row for row in metrics(run_dir) if "rollout/raw_reward" in row]


def trained_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in trained_rows(run_dir)]


def job_log(run_dir: Path) -> str:
    job = json.loads((run_dir / "job.json").read_text())
    return "".join(Path(job[k]).read_text() for k in ("stdout", "stderr") if Path(job[k]).exists())


def listening(two_nodes, node: str) -> list[tuple[str, int, str]]:
    """(address, port, owner's command line) of every listening TCP socket on node."""
    out = two_nodes.on(node, "ss", "-Hltnp")
    rows = []
    for line in out.stdout.splitlines():
        addr, port = line.split()[3].rsplit(":", 1)
        pid = re.search(r"pid=(\d+)", line)
        try:
            cmd = Path(f"/proc/{pid.group(1)}/cmdline").read_bytes().replace(b"\0", b" ").decode() if pid else ""
        except OSError:
            cmd = ""
        rows.append((addr.strip("[]"), int(port), cmd))
    return rows


RAY_WORKER_PORTS = (10002, 19999)
"""Ray's default --min-worker-port / --max-worker-port: each worker process's core-worker gRPC server."""
RUN_PROCESSES = ("ray::TrainRank", "ray::EngineActor", "ray::RolloutManager", "slime_hydra.rollout.engines.embedded",
                 "slime_hydra.rollout.router", "sglang")
"""Command lines of the run's own processes (Ray's services aside): trainer ranks (their process-group stores),
engine actors and servers, the rollout manager and the router."""


OUTSIDER = """
import json, socket, sys
ports = json.loads(sys.argv[1])
reached = []
for host, port in ports:
    try:
        socket.create_connection((host, port), timeout=3).close()
        reached.append([host, port])
    except OSError:
        pass
print(json.dumps(reached))
"""

RAY_JOIN = """
import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    print("joined", len(ray.nodes()))
except Exception as error:
    print("refused:", type(error).__name__, str(error).splitlines()[0][:200])
"""


def test_two_nodes_train_together_behind_closed_doors_and_survive_the_time_limit_signal(two_nodes, tmp_path):
    """One run, checked at each stage:
    - the dry run and the job both show the layout: node 1 the driver + rank 0 + engine 0, node 2 rank 1 + engine 1;
    - paused mid-run (the driver SIGSTOPped), nothing but Ray's own services listens on a site address, an outsider
      on the site network reaches none of the run's ports and cannot join Ray without the job's token;
    - SLURM's time-limit signal: checkpoint, requeue, resume on both nodes, every step logged exactly once;
    - engines on both nodes sample with the weights of every step (distributed broadcast across nodes)."""
    dry = two_nodes.launch(*SMALL, "dry_run=true", f"output_dir={tmp_path}")
    assert dry.returncode == 0, dry.stderr
    assert "node 1 (Ray head: driver, rollout manager, router): train rank 0, engine 0" in dry.stdout
    assert "node 2: train rank 1, engine 1" in dry.stdout
    run_dir = tmp_path / "two"
    out = two_nodes.launch(*SMALL, "num_steps=8", "cluster.ray_port=7168", "run_name=two", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    wait_until(lambda: len(trained_steps(run_dir)) >= 2, 600, "two steps on two nodes", poll_s=2)
    log = job_log(run_dir)
    assert f"node 1 mnode1 ({FABRIC['mnode1']}): driver, rollout manager, router, train rank 0, engine 0" in log
    assert f"node 2 mnode2 ({FABRIC['mnode2']}): train rank 1, engine 1" in log

    driver = json.loads((run_dir / "run.json").read_text())["pid"]
    os.kill(driver, signal.SIGSTOP)  # the run holds still while it is probed
    try:
        sockets = {node: listening(two_nodes, node) for node in ("mnode1", "mnode2")}
        ours = {node: [(a, p, c) for a, p, c in rows if any(r in c for r in RUN_PROCESSES)]
                for node, rows in sockets.items()}
        for node, rows in ours.items():
            wild = [(a, p, c) for a, p, c in rows if a not in ("127.0.0.1", FABRIC[node])]
            # on all interfaces only Ray's own core-worker gRPC server of each actor process (one per process, in
            # Ray's worker port range), which wants the job's token; stores, engines, router: loopback or fabric
            assert all(RAY_WORKER_PORTS[0] <= p <= RAY_WORKER_PORTS[1] for _, p, _ in wild), (node, wild)
            assert len({c for _, _, c in wild}) == len(wild), (node, wild)
        fabric = {node: {c for a, _, c in rows if a == FABRIC[node]} for node, rows in ours.items()}
        assert any("TrainRank" in c for c in fabric["mnode1"]), fabric  # rank 0's process-group store
        assert all(any("engines.embedded" in c for c in cmds) for cmds in fabric.values()), fabric  # engine i
        targets = [[net[node], port] for net in (SITE, FABRIC) for node, rows in sockets.items() for _, port, _ in rows]
        reached = json.loads(two_nodes.on("mout", sys.executable, "-c", OUTSIDER, json.dumps(targets)).stdout)
        assert all(host in SITE.values() for host, _ in reached), reached  # the fabric is out of reach
        our_ports = {port for node, rows in ours.items() for a, port, _ in rows if a in ("127.0.0.1", FABRIC[node])}
        assert not [t for t in reached if t[1] in our_ports], reached
        # what the outsider does reach are Ray's own services (GCS, raylet, agents), which want the job's token:
        gcs = 7168 + int(job_id) % 1000
        join = two_nodes.on("mout", sys.executable, "-c", RAY_JOIN, f"{SITE['mnode1']}:{gcs}", timeout=180,
                            env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
        assert join.stdout.startswith("refused:"), join.stdout + join.stderr
    finally:
        os.kill(driver, signal.SIGCONT)

    two_nodes.on("mnode1", "scancel", "--signal=USR2", job_id)  # what SLURM sends before the time limit
    wait_until(lambda: all(f in two_nodes.on("mnode1", "scontrol", "show", "job", job_id).stdout
                           for f in ("Restarts=1", "JobState=PENDING")), 300, "the job to be requeued and pending")
    two_nodes.on("mnode1", "scontrol", "update", f"JobId={job_id}", "StartTime=now")  # skip the ~2 min hold
    end = two_nodes.wait_for_end(run_dir, 900)
    assert end["state"] == "COMPLETED", end
    assert trained_steps(run_dir) == list(range(1, 9))  # each step once, across the requeue
    steps = [row for row in metrics(run_dir) if "rollout/raw_reward" in row]
    # the samples of both engines were drawn with the weights just trained (broadcast from node 1 to node 2 too):
    # every sample carries the current weight version, and trainer and engines agree to fp32 rounding
    assert max(row["train/train_rollout_logprob_abs_diff"] for row in steps) < 1e-5, steps
    assert all(row["rollout/weight_version_lag"] == 0 for row in steps), steps
    log = job_log(run_dir)
    assert "resumed from" in log and log.count(f"node 2 mnode2 ({FABRIC['mnode2']}): train rank 1, engine 1") == 2
    token = (Path(json.loads((run_dir / "job.json").read_text())["submitit_folder"]) / "ray_auth_token").read_text()
    for path in [run_dir / "metrics.jsonl", *run_dir.rglob("*.yaml"), *run_dir.rglob("*.log*"),
                 *run_dir.rglob("*.out"), *run_dir.rglob("*.err")]:
        assert token not in path.read_text(errors="replace"), path
