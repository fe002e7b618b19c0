"""Where runs stand: ``python -m slime_hydra.status RUN_OR_SWEEP_OR_OUTPUT_DIR``.

One row per run: a run dir (``job.json`` for a SLURM job that launch/submit.py wrote, ``run.json`` for a run the
loop drove here), a sweep dir (sweep.json and one run dir per point), or a directory of run dirs (output_dir).
Columns: job id, state, last step and last reward (the last ``step`` and ``rollout/raw_reward`` in
``metrics.jsonl``), the newest checkpoint, the log paths. A local run's state is its ``run.json``: RUNNING while
its driver's pid lives (on this host), DONE, PREEMPTED (a checkpoint was written: run the command again),
FAILED (with the error), or DIED when the driver is gone without a word (killed: resume from the checkpoint). The state comes from ``sacct``, else ``squeue -t all``, else
``scontrol show job``, each bounded by a timeout: a dead controller gives UNKNOWN, never a hang. A failed job
shows why: the error its task recorded as JSON (``<folder>/<job_id>_<rank>_error.json``, launch/submit.py; rank 0's
first), else the last line of rank 0's stderr log (a task killed before Python could record anything, e.g. slurmstepd's
out-of-memory line; srun's own exit line is skipped), else SLURM's reason and exit code.

Nothing a run directory points to is unpickled: submitit's result files are pickles, and loading one runs whatever
code its writer put in it, so status reads only JSON and text.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from rich.console import Console
from rich.table import Table

from slime_hydra.checkpoint import JOB_ERROR, LATEST, RUN_RECORD

QUERY_TIMEOUT_S = 10
"""Seconds one sacct/squeue/scontrol call may take."""
LOG_TAIL_BYTES = 64 * 1024
"""How much of the end of a stderr log is read to find its last line."""


@dataclass
class RunStatus:
    run_dir: Path
    """The run directory."""
    job_id: str
    """SLURM job id ("" when the run has no job.json)."""
    state: str
    """SLURM state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, REQUEUED, ... or UNKNOWN."""
    reason: str
    """Why a job failed (or is pending); "" otherwise."""
    last_step: Optional[int]
    """The last step in metrics.jsonl; None before the first."""
    last_reward: Optional[float]
    """The last rollout/raw_reward in metrics.jsonl; None before the first."""
    checkpoint: str
    """The newest complete checkpoint (checkpoints/latest), "" when none."""
    logs: list[str]
    """rank 0's stdout and stderr."""


def _run(args: list[str]) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def _table(text: str, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """'a|b|c' lines (with or without a header line) -> {job id: {name: value}}."""
    names = list(names)
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        values = line.strip().split("|")
        if not values[0] or values[0] == names[0] or "." in values[0]:  # header, blank, job steps (123.batch)
            continue
        rows.setdefault(values[0], dict(zip(names, values)))
    return rows


def slurm_states(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """{job id: {"State", "Reason", "ExitCode"}} from sacct, else squeue, else scontrol; missing ids absent."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    names = ("JobID", "State", "ExitCode", "Reason")
    found = _table(_run(["sacct", "-X", "-P", "-n", "-o", ",".join(names), "-j", ids]), names)
    missing = [j for j in job_ids if j not in found]
    if missing:
        squeue = _table(_run(["squeue", "-h", "-t", "all", "-j", ",".join(missing), "-o", "%i|%T|%r"]),
                        ("JobID", "State", "Reason"))
        found.update(squeue)
    for job_id in [j for j in job_ids if j not in found]:
        fields = dict(tok.split("=", 1) for tok in _run(["scontrol", "-o", "show", "job", job_id]).split()
                      if "=" in tok)
        if "JobState" in fields:
            found[job_id] = {"JobID": job_id, "State": fields["JobState"], "Reason": fields.get("Reason", ""),
                             "ExitCode": fields.get("ExitCode", "")}
    for row in found.values():
        row["State"] = row.get("State", "UNKNOWN").split()[0].rstrip("+")  # "CANCELLED by 0" -> CANCELLED
    return found


def last_metrics(run_dir: Path) -> tuple[Optional[int], Optional[float]]:
    """The last step and the last rollout/raw_reward in metrics.jsonl (bad lines are skipped)."""
    step, reward = None, None
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return step, reward
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            step = row.get("step", step)
            reward = row.get("rollout/raw_reward", reward)
    return step, reward


def _error_line(job: dict) -> str:
    """Why a failed job failed: the first line of the error a task recorded (rank 0's, else the lowest rank's, named),
    else the last line of rank 0's stderr log; "" when neither says anything."""
    job_id, folder = str(job.get("job_id")), job.get("submitit_folder")
    recorded = {}
    for path in Path(folder).glob(JOB_ERROR.format(job_id=job_id, rank="*")) if folder else ():
        try:
            record = json.loads(path.read_text())
            rank, error = int(record["rank"]), str(record["error"]).strip()
        except (OSError, ValueError, KeyError, TypeError):  # unreadable or partial: the other sources remain
            continue
        if error:
            recorded[rank] = error.splitlines()[0]
    if recorded:
        rank = min(recorded)
        return recorded[rank] if rank == 0 else f"rank {rank}: {recorded[rank]}"
    return _last_line(Path(job["stderr"])) if job.get("stderr") else ""


def _last_line(path: Path) -> str:
    """The last non-blank line of a task's log that is not srun's own ``srun: error: <host>: task 0: Exited with exit
    code 1`` (which says no more than the exit code); "" when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip() and not ln.startswith("srun: ")]
    return lines[-1] if lines else ""


MARKERS = ("job.json", RUN_RECORD)
"""Files that make a directory a run dir: a SLURM job's, a local run's."""


def run_dirs(path: Path) -> list[Path]:
    """The run dirs under path: itself, a sweep manifest's points, or subdirs holding a marker."""
    if any((path / m).exists() for m in MARKERS):
        return [path]
    manifest = path / "sweep.json"
    if manifest.exists():
        return [Path(p["run_dir"]) for p in json.loads(manifest.read_text())["points"]]
    found = {p.parent for m in MARKERS for p in path.glob(f"*/{m}")}
    return sorted(found, key=lambda p: (len(p.name), p.name))


def local_state(run_dir: Path) -> tuple[str, str]:
    """(state, reason) of a run the loop drove on this machine, from its run.json (module docstring)."""
    try:
        record = json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return "UNKNOWN", f"{RUN_RECORD} unreadable"
    outcome = record.get("outcome")
    if outcome == "running":
        if record.get("host") != socket.gethostname():
            return "UNKNOWN", f"driver pid {record.get('pid')} on {record.get('host')}"
        if _alive(int(record.get("pid", -1))):
            return "RUNNING", ""
        return "DIED", "the driver is gone without recording an outcome; run the same command to resume"
    if outcome == "preempted":
        return "PREEMPTED", "a checkpoint was written; run the same command to resume"
    return str(outcome).upper(), error_summary(record.get("error") or "")


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_summary(error: str) -> str:
    """One readable line of the error a run recorded: without terminal colour codes, and for a multi-line error (a
    Ray actor's traceback) its last line, the exception the actor raised, pointing to run.json for the whole."""
    lines = [line.strip() for line in ANSI_ESCAPE.sub("", error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[-1]} (the whole error: {RUN_RECORD})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def newest_checkpoint(run_dir: Path) -> str:
    pointer = run_dir / "checkpoints" / LATEST
    return pointer.read_text().strip() if pointer.exists() else ""


def collect(path: Path) -> list[RunStatus]:
    """The status of every run under path (see run_dirs)."""
    runs = run_dirs(path)
    jobs = {run: json.loads((run / "job.json").read_text()) if (run / "job.json").exists() else {} for run in runs}
    states = slurm_states([str(job["job_id"]) for job in jobs.values() if job.get("job_id")])
    out = []
    for run, job in jobs.items():
        job_id = str(job.get("job_id", ""))
        slurm = states.get(job_id, {})
        state = slurm.get("State", "UNKNOWN" if job_id else "NOT SUBMITTED")
        reason = ""
        if not job_id and (run / RUN_RECORD).exists():
            state, reason = local_state(run)
        elif state not in ("COMPLETED", "RUNNING", "UNKNOWN", "NOT SUBMITTED"):
            reason = _error_line(job) if state == "FAILED" else ""
            if not reason:
                slurm_reason = slurm.get("Reason", "")
                reason = ", ".join(x for x in (slurm_reason if slurm_reason not in ("None", "") else "",
                                               f"exit code {slurm['ExitCode']}" if slurm.get("ExitCode") not in
                                               (None, "", "0:0") else "") if x)
        step, reward = last_metrics(run)
        out.append(RunStatus(run_dir=run, job_id=job_id, state=state, reason=reason, last_step=step,
                             last_reward=reward, checkpoint=newest_checkpoint(run),
                             logs=[job[k] for k in ("stdout", "stderr") if k in job]))
    return out


def render(statuses: list[RunStatus], title: str) -> Table:
    table = Table(title=title)
    for column in ("run", "job", "state", "step", "reward", "checkpoint", "logs"):
        table.add_column(column, overflow="fold")
    colour = {"COMPLETED": "green", "DONE": "green", "RUNNING": "cyan", "PENDING": "yellow", "FAILED": "red",
              "CANCELLED": "magenta", "TIMEOUT": "red", "OUT_OF_MEMORY": "red", "DIED": "red", "PREEMPTED": "yellow"}
    for s in statuses:
        state = f"[{colour.get(s.state, 'white')}]{s.state}[/]" + (f"\n{s.reason}" if s.reason else "")
        table.add_row(s.run_dir.name, s.job_id or "-", state, "-" if s.last_step is None else str(s.last_step),
                      "-" if s.last_reward is None else f"{s.last_reward:.4g}", s.checkpoint or "-",
                      "\n".join(s.logs) or "-")
    return table


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.status", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory, a sweep directory (sweep.json) or a directory of "
                                                "run directories (output_dir)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"slime_hydra.status: no runs yet: {args.path} does not exist (launch.py creates it with the first run)",
              file=sys.stderr)
        return 1
    if not args.path.is_dir():
        print(f"slime_hydra.status: {args.path} is not a directory", file=sys.stderr)
        return 2
    statuses = collect(args.path.resolve())
    if args.json:
        for s in statuses:
            print(json.dumps({**s.__dict__, "run_dir": str(s.run_dir)}))
    elif statuses:
        Console(soft_wrap=True).print(render(statuses, str(args.path)))
    else:
        print(f"slime_hydra.status: no runs under {args.path} (no job.json, run.json or sweep.json)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
