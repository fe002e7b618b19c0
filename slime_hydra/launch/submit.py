"""SLURM submission through submitit, and the function every task of the job runs.

    submit(cfg, derived, run_dir, overrides)   sbatch through submitit; prints the job id and returns (no waiting)
    SlurmRun(body)(cfg, run_dir)                inside the allocation: Ray across the tasks, the body on rank 0

What reaches the sbatch script and the shell, and how it is quoted:

- every ``#SBATCH`` value (job name, partition, account, qos, constraint, memory, log paths, ``sbatch_extra``)
  is written by submitit as ``#SBATCH --key=<shlex.quote(value)>``, and the srun command line quotes the python
  path and the submitit folder: an output directory or account with spaces, quotes, ``$(...)`` or ``;`` arrives literally;
- ``cluster.setup`` lines are shell lines by design (``module load ...``, ``source .../activate``) and are
  written verbatim: they come from the site's cluster YAML, which is trusted like a job script;
- nothing else is interpolated into the script: the config and the run directory travel in submitit's pickle.

The job folder is fresh for every submission (``<run_dir>/slurm/<timestamp>``): job ids restart when a
cluster's state is wiped, and a reused folder would hand back an old job's result. ``<run_dir>/job.json``
records the job id, the folder, the log paths and the overrides (``python -m slime_hydra.status`` reads it).

Preemption: the job function is a ``submitit.helpers.Checkpointable``. When SLURM sends the time-limit signal
(``USR2@90`` by default, or the site's ``--signal=...`` in ``cluster.sbatch_extra``), preempt.py records
it; the body checkpoints at its next step boundary and returns ``"preempted"``; Ray is torn down; then submitit's
own requeue handler runs ``checkpoint()`` (this function again, with ``resume=auto``) and ``scontrol requeue``.
The requeued job starts from the newest checkpoint in the same run directory.

A task that fails writes why to ``<folder>/<job_id>_<rank>_error.json`` (``record_failure``: the error line, the
traceback, the host) before submitit records the exception its own way, so ``python -m slime_hydra.status`` can show
it without unpickling anything (submitit's result file is a pickle, which runs code when loaded).
"""

import dataclasses
import json
import os
import socket
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import submitit
from rich.console import Console

from slime_hydra import preempt
from slime_hydra.checkpoint import JOB_ERROR
from slime_hydra.durable import write_json
from slime_hydra.config.derive import Derived
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.dotted import import_callable
from slime_hydra.launch.slurm import sbatch_parameters

TRACEBACK_CHARS = 8000
"""The end of a failed task's traceback kept in its error record."""


def resolve_body(path: str) -> Callable[[SlimeConfig, Path], Any]:
    """'package.module.function' (or 'package.module:function') -> the function."""
    return import_callable(path, "the job body", "fn(cfg, run_dir)")


class SlurmRun(submitit.helpers.Checkpointable):
    """What every task of the SLURM job runs: Ray node (head on rank 0), the body on rank 0, teardown, requeue."""

    def __init__(self, body: str):
        self.body = body
        """Dotted path of body(cfg, run_dir), run on rank 0 as the Ray driver (RAY_ADDRESS set): cluster.job_body."""

    def __call__(self, cfg: SlimeConfig, run_dir: str) -> Optional[str]:
        self.lost = ""  # set when the body failed because nodes were lost: which, and what ran there
        try:
            return self._run(cfg, run_dir)
        except Exception as error:
            try:
                record_failure(error, self.lost)
            except OSError as unwritten:  # the job's own error matters more than its record
                print(f"could not record the failure in the submitit folder: {unwritten}", flush=True)
            raise

    def _run(self, cfg: SlimeConfig, run_dir: str) -> Optional[str]:
        from slime_hydra.cluster.ray_cluster import RayCluster

        preempt.install()
        with RayCluster(cfg.cluster) as ray_cluster:
            if not ray_cluster.is_head:
                ray_cluster.serve()
                return None
            body = resolve_body(self.body)  # after RayCluster set Ray's environment: the body may import Ray
            os.environ["RAY_ADDRESS"] = ray_cluster.address
            layout = node_layout(cfg, ray_cluster.env.hostnames)
            for _, line in layout:
                print(line, flush=True)
            try:
                outcome = body(cfg, Path(run_dir))
            except Exception:
                gone = ray_cluster.lost_nodes()
                lost = [line for ip, line in layout if ip in gone]
                if lost:
                    self.lost = f"lost {'; '.join(lost)}"
                    print(self.lost, flush=True)
                raise
        if outcome == "preempted" or preempt.requested():
            self._requeue()
        return outcome

    def checkpoint(self, cfg: SlimeConfig, run_dir: str) -> submitit.helpers.DelayedSubmission:
        """The requeued job: this function again, resuming from the newest checkpoint of run_dir."""
        return submitit.helpers.DelayedSubmission(self, dataclasses.replace(cfg, resume="auto"), run_dir)

    @staticmethod
    def _requeue() -> None:
        """Hand over to submitit's requeue handler (it calls checkpoint(), scontrol requeue, and exits)."""
        if preempt.signal_name() == "SIGTERM":
            # scancel (the user wants it gone), or a preemption that SLURM itself requeues (PreemptMode=REQUEUE)
            print("SIGTERM: checkpoint written; not requeueing from the job", flush=True)
            return
        usr_sig = submitit.JobEnvironment._usr_sig()
        handler = preempt.previous.get(usr_sig)
        if not callable(handler):
            print("no submitit requeue handler installed: not requeued", flush=True)
            return
        try:
            handler(usr_sig, None)
        except subprocess.CalledProcessError as error:  # scontrol requeue refused (e.g. the job is being cancelled)
            print(f"requeue failed: {error}", flush=True)


def node_layout(cfg: SlimeConfig, hostnames: Sequence[str]) -> list[tuple[str, str]]:
    """Per node of the job, its address and ``node 2 mnode2 (10.77.0.2): train rank 1, engine 1`` (config/derive.py
    node_roles; the run pins its placement to it)."""
    from slime_hydra.config.derive import derive, node_roles

    roles = node_roles(cfg, derive(cfg))
    lines = []
    for k, host in enumerate(hostnames):
        what = roles[k] if k < len(roles) else []
        head = ["driver", "rollout manager", "router"] if k == 0 else []
        ip = socket.gethostbyname(host)
        lines.append((ip, f"node {k + 1} {host} ({ip}): {', '.join(head + what) or 'nothing'}"))
    return lines


def record_failure(error: BaseException, where: str = "") -> Path:
    """Write why this task of the job failed to its error record in the submitit folder; return the path. ``where``
    (the node lost and what ran there) comes first in the error line."""
    env = submitit.JobEnvironment()
    path = env.paths.folder / JOB_ERROR.format(job_id=env.job_id, rank=env.global_rank)
    write_json(path, {"job_id": env.job_id, "rank": env.global_rank, "host": socket.gethostname(),
                      "error": f"{where + ': ' if where else ''}{type(error).__name__}: {error}"[:2000],
                      "traceback": "".join(traceback.format_exception(error))[-TRACEBACK_CHARS:],
                      "time": time.time()})
    return path


@dataclasses.dataclass
class SubmittedJob:
    job_id: str
    """SLURM job id."""
    run_dir: Path
    """The run directory (job.json, metrics.jsonl, checkpoints)."""
    folder: Path
    """submitit's folder: the sbatch script, pickles and the per-task logs."""
    job: submitit.Job
    """submitit's handle (state, result, cancel)."""


def fresh_folder(run_dir: Path) -> Path:
    """<run_dir>/slurm/<YYYYmmdd-HHMMSS>[-n], never reused."""
    base = run_dir / "slurm" / time.strftime("%Y%m%d-%H%M%S")
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def submit(cfg: SlimeConfig, derived: Derived, run_dir: Path, overrides: Sequence[str], *,
           tasks_per_node: int = 1, console: Optional[Console] = None) -> SubmittedJob:
    """sbatch the run; write <run_dir>/job.json; print the job id and run dir; return without waiting.

    tasks_per_node > 1 runs several Ray nodes per SLURM node (tests emulate a multi-node job on one host).
    """
    from slime_hydra.cluster.ray_cluster import write_token

    folder = fresh_folder(run_dir)
    write_token(folder)
    params = sbatch_parameters(cfg.cluster, derived, job_name=run_dir.name)
    params["ntasks_per_node"] = tasks_per_node
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**params)
    job = executor.submit(SlurmRun(cfg.cluster.job_body), cfg, str(run_dir))
    record = {
        "job_id": job.job_id,
        "run_dir": str(run_dir),
        "submitit_folder": str(folder),
        "stdout": str(job.paths.stdout),
        "stderr": str(job.paths.stderr),
        "overrides": list(overrides),
        "nodes": derived.nodes,
        "tasks_per_node": tasks_per_node,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "body": cfg.cluster.job_body,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(record, indent=2) + "\n")
    (console or Console(soft_wrap=True)).print(
        f"submitted SLURM job {job.job_id}: {run_dir}\n  logs: {job.paths.stdout}\n"
        f"  status: python -m slime_hydra.status {run_dir}", markup=False, highlight=False)
    return SubmittedJob(job_id=job.job_id, run_dir=run_dir, folder=folder, job=job)

