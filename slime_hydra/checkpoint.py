"""Run checkpoints: everything needed to continue a run exactly where it stopped.

Layout (``k`` = rollout steps completed)::

    <run_dir>/checkpoints/step_000040/
        actor/            the trainer's resumable checkpoint (model, optimizer, scheduler, RNG, step; backend's own)
        critic/           PPO only
        rollout.json      the prompt cursor and the buffer (RolloutManager.state_dict)
        loop.json         {"step": k, "next_rollout": ... | null}  (the engines' weight version after a resume is k)
    <run_dir>/checkpoints/latest     the name of the newest complete checkpoint
    <run_dir>/export/step_000200/    the policy as an HF checkpoint (a finished run's last step; export.py any step)

``latest`` is written (atomically: temp file + rename) only after everything else is on disk (every file and
folder fsynced), so a crash during a save leaves the previous checkpoint as the newest. With
``checkpoint_in_background`` (the default) the trainer ranks copy their state to host memory and write their files
from a thread (train/checkpoint_writer.py) while the run goes on; the loop writes rollout.json and loop.json of the
same step at once, and moves ``latest`` (``complete``) at a later step boundary, once every rank reported its files
fsynced; a save first waits for the previous one. When to save: ``save_every_steps``, ``save_every_minutes`` since
the last save, the end of the run, a signal (these last two wait for the write); ``keep_checkpoints`` newest are
kept, older ones deleted once a newer one is complete (``prune``). In async mode the rollout already generating for
the next step is finished and kept in ``loop.json`` (``next_rollout``), so no sample is lost or generated twice.

``resume``: ``auto`` continues from ``latest`` when it exists (else starts fresh), ``never`` always starts fresh,
anything else is a checkpoint directory to start from.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

LATEST = "latest"
RUN_RECORD = "run.json"
"""<run_dir>/run.json: the driver's host, pid and start time, then how the run ended (loop.run writes it)."""
JOB_ERROR = "{job_id}_{rank}_error.json"
"""In a SLURM job's submitit folder, beside submitit's own per-task files: why that task failed, as JSON
(launch/submit.py writes it, status.py shows it)."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def export_dir(run_dir: Path, step: int) -> Path:
    """Where the HF export of checkpoint ``step_<N>`` goes (the run's own at its end, or export.py's)."""
    return Path(run_dir) / "export" / f"step_{step:06d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories themselves to disk (before ``latest`` points at it)."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def _replace_durably(tmp: Path, path: Path) -> None:
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(path.parent)


def mark_latest(run_dir: Path, ckpt: Path) -> None:
    """Point ``latest`` at ckpt (atomic rename, flushed to disk)."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(ckpt.name + "\n")
    _replace_durably(tmp, pointer)


def complete(run_dir: Path, ckpt: Path, keep: int) -> None:
    """ckpt is written (every trainer rank's files fsynced): flush its folder, point ``latest`` at it, prune."""
    fsync_tree(ckpt)
    mark_latest(run_dir, ckpt)
    prune(run_dir, keep)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    _replace_durably(tmp, path)


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names); returns what was deleted.
    keep=0 deletes nothing."""
    folder = Path(run_dir) / "checkpoints"
    pointer = folder / LATEST
    if keep <= 0 or not pointer.exists():
        return []
    latest = pointer.read_text().strip()
    steps = sorted(p for p in folder.glob("step_*") if p.is_dir())
    old = [p for p in steps[:-keep] if p.name != latest]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def find_resume(resume: str, run_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from, or None to start fresh (see the module docstring)."""
    if resume == "never":
        return None
    if resume == "auto":
        pointer = Path(run_dir) / "checkpoints" / LATEST
        if not pointer.exists():
            return None
        return pointer.parent / pointer.read_text().strip()
    path = Path(resume)
    if not (path / "loop.json").exists():
        raise FileNotFoundError(f"resume={resume}: not a checkpoint directory (no loop.json); give "
                                "<run_dir>/checkpoints/step_NNNNNN, or resume=auto")
    return path
