"""Real SLURM jobs (one 2-CPU node on loopback, partition debug): Ray bootstrap, a sweep, cancel, requeue, quoting.

Jobs run small bodies from tests/slurm/bodies.py (cluster.job_body) with one CPU per Ray node. The real loop as
the job body (the embedded default through submitit, its metrics in the run dir, a requeue, node faults) runs on the
two-node cluster of tests/multinode, which CI also runs every time.
"""

import json
import pickle
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slime_hydra import status
from slime_hydra.config import PROJECT_ROOT, compose, to_config, validate
from slime_hydra.launch.submit import submit

CLUSTER = ("cluster=slurm", "cluster.gpus_per_node=0", "cluster.partition=debug", "cluster.cpus_per_node=1",
           "cluster.time_min=5", "cluster.ray_wait_nodes_s=60")
"""A 1-CPU Ray node per task on the CI node (CPUs=2: two tasks, or two jobs, at a time)."""

pytestmark = pytest.mark.usefixtures("slurm")  # one worker, one test at a time (tests/conftest.py ONE_AT_A_TIME)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def submit_body(tmp_path: Path, name: str, body: str, *overrides: str, tasks_per_node: int = 1):
    cfg = to_config(compose([*CLUSTER, f"cluster.job_body=tests.slurm.bodies.{body}", *overrides]))
    return submit(cfg, validate(cfg), tmp_path / name, list(overrides), tasks_per_node=tasks_per_node)


def finished(job, timeout_s: float = 300) -> list:
    """The job's results, failing (never hanging) when it does not finish in time, e.g. stuck pending."""
    def done() -> bool:
        return job.job.done()

    try:
        wait_until(done, timeout_s, f"job {job.job_id} to finish")
    except AssertionError as error:
        reason = subprocess.run(["squeue", "-h", "-j", job.job_id, "-o", "%T %r"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        raise AssertionError(f"{error}; squeue says: {reason or 'gone'}") from None
    return job.job.results()


def state_of(run_dir: Path) -> status.RunStatus:
    (run,) = status.collect(run_dir)
    return run


def ray_processes(job_id: str) -> str:
    out = subprocess.run(["pgrep", "-af", f"/tmp/ray_{job_id}"], capture_output=True, text=True)
    return out.stdout.strip()


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_two_tasks_form_one_ray_cluster(tmp_path):
    """Head on rank 0, rank 1 joins: the body sees 2 nodes and 2 CPUs; workers carry no SLURM/PMI variables;
    no Ray process or temp dir outlives the job."""
    job = submit_body(tmp_path, "ray", "ray_nodes", tasks_per_node=2)
    assert finished(job)[0] == "done"
    seen = json.loads((tmp_path / "ray" / "ray.json").read_text())
    assert seen["nodes"] == 2 and seen["cpus"] == 2
    assert seen["worker_scheduler_env"] == {}
    wait_until(lambda: not ray_processes(job.job_id), 15, "the job's Ray processes to exit")
    # the job's temp dirs (/tmp/ray_<id>, /tmp/ray_<id>_<rank>), not another job's /tmp/ray_<id>0
    assert not [p for p in Path("/tmp").glob(f"ray_{job.job_id}*")
                if p.name == f"ray_{job.job_id}" or p.name.startswith(f"ray_{job.job_id}_")]
    record = json.loads((tmp_path / "ray" / "job.json").read_text())
    assert record["job_id"] == job.job_id and Path(record["submitit_folder"]).parent == tmp_path / "ray" / "slurm"


NASTY = 'q a"b $(touch HACKED) ; echo x'
"""A directory name with spaces, quotes, $(...) and ; (the sweep's jobs run in it, and the shell-syntax test's dry run
renders it)."""


def test_sweep_submits_every_point_as_its_own_job(tmp_path):
    """Also: the sweep's directory has shell syntax in its name (NASTY), which arrives literally in each job."""
    sweep_dir = tmp_path / NASTY / "sweep"
    out = launch("-m", *CLUSTER, "cluster.job_body=tests.slurm.bodies.metrics", "num_steps=2,3", "seed=1,2",
                 f"hydra.sweep.dir='{sweep_dir}'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("submitted SLURM job") == 4
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    points = manifest["points"]
    assert [p["num"] for p in points] == [0, 1, 2, 3] and all(p["job_id"] for p in points)
    assert len({p["job_id"] for p in points}) == 4 and len({p["run_dir"] for p in points}) == 4
    assert {"num_steps=3", "seed=2"} <= set(points[3]["overrides"])
    done = wait_until(lambda: all(s.state == "COMPLETED" for s in status.collect(sweep_dir)) and status.collect(sweep_dir),
                      150, "all 4 points to complete", poll_s=2)
    assert [s.last_step for s in done] == [2, 2, 3, 3] and done[2].last_reward == 0.5
    table = subprocess.run([sys.executable, "-m", "slime_hydra.status", str(sweep_dir)], capture_output=True,
                           text=True, timeout=30)
    assert table.returncode == 0 and table.stdout.count("COMPLETED") == 4
    shown = subprocess.run(["scontrol", "show", "job", points[0]["job_id"]], capture_output=True, text=True,
                           timeout=10).stdout
    assert f"StdOut={points[0]['run_dir']}" in shown  # the job's log went to the literal directory
    assert not list(tmp_path.rglob("HACKED")) and not (PROJECT_ROOT / "HACKED").exists()


def test_sweep_refuses_before_submitting_when_any_point_is_invalid(tmp_path):
    out = launch("-m", *CLUSTER, "cluster.job_body=tests.slurm.bodies.metrics", "rollout.n_samples_per_prompt=1,8",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert out.returncode == 2
    assert "point 0 (rollout.n_samples_per_prompt=1)" in out.stderr and "submitted" not in out.stdout
    assert not (tmp_path / "sweep" / "sweep.json").exists()


def test_sweep_dry_run_prints_points_and_scripts_and_leaves_nothing(tmp_path):
    out = launch("-m", *CLUSTER, "cluster.gpus_per_node=8", "train.micro_batch_samples=16", "train.num_gpus=8,16",
                 "dry_run=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Sweep: 2 points (dry run: nothing is submitted)" in out.stdout
    assert out.stdout.count("#SBATCH --nodes=") == 2 and "#SBATCH --nodes=2" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_cancelled_job_shows_cancelled_and_nothing_waits_forever(tmp_path):
    job = submit_body(tmp_path, "cancel", "sleep_until_signalled")
    wait_until(lambda: (tmp_path / "cancel" / "started").exists(), 90, "the job to start")
    subprocess.run(["scancel", job.job_id], check=True, timeout=10)
    run = wait_until(lambda: (lambda s: s if s.state == "CANCELLED" else None)(state_of(tmp_path / "cancel")), 30,
                     "status to report CANCELLED")
    assert run.job_id == job.job_id
    waited = threading.Thread(target=lambda: job.job.exception(), daemon=True)  # submitit must not block either
    waited.start()
    waited.join(timeout=60)
    assert not waited.is_alive(), "submitit waited on a cancelled job"
    wait_until(lambda: not ray_processes(job.job_id), 20, "the cancelled job's Ray processes to exit")


def test_failed_job_shows_failed_with_its_reason(tmp_path, monkeypatch):
    """The reason comes from the task's JSON error record; status unpickles nothing (pickle refuses meanwhile)."""
    job = submit_body(tmp_path, "fail", "crash")
    wait_until(lambda: job.job.done(), 90, "the job to end")

    def refuse(*args, **kwargs):
        raise AssertionError("status unpickled a file")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    run = wait_until(lambda: (lambda s: s if s.state == "FAILED" else None)(state_of(tmp_path / "fail")), 30,
                     "status to report FAILED")
    assert run.reason == "RuntimeError: deliberate crash in the job body"
    assert (job.folder / f"{job.job_id}_0_error.json").exists()


def test_time_limit_signal_requeues_and_the_job_resumes(tmp_path):
    job = submit_body(tmp_path, "requeue", "preempt_then_resume", "resume=never")
    run_dir = tmp_path / "requeue"
    wait_until(lambda: (run_dir / "started").exists(), 90, "the first start")
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=10)  # what SLURM sends at --signal
    # slurmctld holds a requeued job for ~2 minutes (EligibleTime = requeue + 121 s); release it now
    wait_until(lambda: all(f in subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True, text=True,
                                               timeout=10).stdout for f in ("Restarts=1", "JobState=PENDING")),
               60, "the job to be requeued and pending")
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True, timeout=10)
    resumed = wait_until(lambda: (run_dir / "resumed.json").exists() and json.loads((run_dir / "resumed.json").read_text()),
                         150, "the requeued job to resume", poll_s=1)
    first = json.loads((run_dir / "checkpoint.json").read_text())
    assert first == {"starts": 1, "signal": "SIGUSR2", "resume": "never"}
    assert resumed["resume"] == "auto" and resumed["starts"] == 2 and resumed["job_id"] == job.job_id
    assert finished(job)[0] == "done"


def test_values_with_shell_syntax_arrive_literally(tmp_path):
    """Spaces, quotes, $(...) and ; in the output directory (log paths, run dir) and in account/qos strings render
    quoted in the sbatch script (a real job in such a directory: the sweep test above).

    run_name (the job name) is refused unless it is a plain directory name, so shell syntax cannot come that way."""
    nasty = NASTY
    refused = launch(*CLUSTER, f"run_name='{nasty}'", "dry_run=true", cwd=tmp_path)
    assert refused.returncode == 2 and "[run_name]" in refused.stderr and "plain directory name" in refused.stderr

    out = tmp_path / nasty
    dry = launch(*CLUSTER, "run_name=quoted", f"output_dir='{out}'", "cluster.account=\"o'brien $(touch HACKED); x\"",
                 "cluster.qos='a b;c'", "dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    lines = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in dry.stdout.splitlines() if ln.startswith("#SBATCH --")}
    assert shlex.split(lines["#SBATCH --account"]) == ["o'brien $(touch HACKED); x"]
    assert shlex.split(lines["#SBATCH --qos"]) == ["a b;c"]
    assert shlex.split(lines["#SBATCH --job-name"]) == ["quoted"]
    assert shlex.split(lines["#SBATCH --output"])[0].startswith(str(out / "quoted"))
    assert not list(tmp_path.rglob("HACKED")) and not (PROJECT_ROOT / "HACKED").exists()
