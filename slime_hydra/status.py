"""Where SLURM runs stand: ``python -m slime_hydra.status RUN_OR_SWEEP_DIR``.

One row per run (a run dir holds the job.json that launch/submit.py wrote; a sweep dir holds sweep.json and one
run dir per point): job id, state, last step and last reward (the last ``step`` and ``rollout/raw_reward`` in
``metrics.jsonl``), the log paths. The state comes from ``sacct``, else ``squeue -t all``, else
``scontrol show job``, each bounded by a timeout: a dead controller gives UNKNOWN, never a hang. A failed job
shows why: the last line of the exception submitit recorded for rank 0, else SLURM's reason and exit code.
"""

import argparse
import json
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from rich.console import Console
from rich.table import Table

QUERY_TIMEOUT_S = 10
"""Seconds one sacct/squeue/scontrol call may take."""


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
    """The last line of the exception submitit pickled for rank 0, if the job failed inside Python."""
    result = Path(job.get("submitit_folder", "")) / f"{job.get('job_id')}_0_result.pkl"
    try:
        outcome, payload = pickle.loads(result.read_bytes())
    except Exception:  # missing, partial or unreadable: the job died without writing it
        return ""
    lines = [ln for ln in str(payload).splitlines() if ln.strip()] if outcome == "error" else []
    return lines[-1].strip() if lines else ""


def run_dirs(path: Path) -> list[Path]:
    """The run dirs under path: itself (job.json), a sweep manifest's points, or subdirs holding job.json."""
    if (path / "job.json").exists():
        return [path]
    manifest = path / "sweep.json"
    if manifest.exists():
        return [Path(p["run_dir"]) for p in json.loads(manifest.read_text())["points"]]
    return sorted((p.parent for p in path.glob("*/job.json")), key=lambda p: (len(p.name), p.name))


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
        if state not in ("COMPLETED", "RUNNING", "UNKNOWN", "NOT SUBMITTED"):
            reason = _error_line(job) if state == "FAILED" else ""
            if not reason:
                slurm_reason = slurm.get("Reason", "")
                reason = ", ".join(x for x in (slurm_reason if slurm_reason not in ("None", "") else "",
                                               f"exit code {slurm['ExitCode']}" if slurm.get("ExitCode") not in
                                               (None, "", "0:0") else "") if x)
        step, reward = last_metrics(run)
        out.append(RunStatus(run_dir=run, job_id=job_id, state=state, reason=reason, last_step=step,
                             last_reward=reward, logs=[job[k] for k in ("stdout", "stderr") if k in job]))
    return out


def render(statuses: list[RunStatus], title: str) -> Table:
    table = Table(title=title)
    for column in ("run", "job", "state", "step", "reward", "logs"):
        table.add_column(column, overflow="fold")
    colour = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow", "FAILED": "red", "CANCELLED": "magenta",
              "TIMEOUT": "red", "OUT_OF_MEMORY": "red"}
    for s in statuses:
        state = f"[{colour.get(s.state, 'white')}]{s.state}[/]" + (f"\n{s.reason}" if s.reason else "")
        table.add_row(s.run_dir.name, s.job_id or "-", state, "-" if s.last_step is None else str(s.last_step),
                      "-" if s.last_reward is None else f"{s.last_reward:.4g}", "\n".join(s.logs) or "-")
    return table


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.status", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory (job.json) or a sweep directory (sweep.json)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)
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
        print(f"no runs under {args.path} (no job.json or sweep.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
