"""Run checkpoints: everything needed to continue a run exactly where it stopped.

Layout (``k`` = rollout steps completed)::

    <run_dir>/checkpoints/step_000040/
        actor/            the trainer's resumable checkpoint (model, optimizer, scheduler, RNG, step; backend's own)
        critic/           PPO only
        rollout.json      the prompt cursor and the buffer (RolloutManager.state_dict)
        loop.json         {"step": k, "next_rollout": ... | null}  (the engines' weight version after a resume is k)
    <run_dir>/checkpoints/latest     the name of the newest complete checkpoint

``latest`` is written (atomically: temp file + rename) only after everything else, so a crash during a save
leaves the previous checkpoint as the newest. In async mode the rollout already generating for the next step is
finished and kept in ``loop.json`` (``next_rollout``), so no sample is lost or generated twice.

``resume``: ``auto`` continues from ``latest`` when it exists (else starts fresh), ``never`` always starts fresh,
anything else is a checkpoint directory to start from.
"""

import json
import os
from pathlib import Path
from typing import Any, Optional

LATEST = "latest"
RUN_RECORD = "run.json"
"""<run_dir>/run.json: the driver's host, pid and start time, then how the run ended (loop.run writes it)."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def mark_latest(run_dir: Path, ckpt: Path) -> None:
    """Point ``latest`` at ckpt (atomic rename)."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(ckpt.name + "\n")
    os.replace(tmp, pointer)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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
