"""The run directory and its provenance, launch by launch: what ran, from which code, with which packages.

    <output_dir>/<run_name>/
      resolved.yaml    the composed config with every interpolation resolved
      overrides.yaml   the command-line overrides, as typed
      git.txt          commit sha, branch, and whether the tree was dirty
      git.diff         uncommitted changes to tracked files (empty when clean)
      versions.json    python and the versions of the packages that shape results
      launches/<NNN>-<YYYYmmdd-HHMMSS>/   the same five files of each launch (001 the first), never rewritten

The top-level files are the latest launch's: the config the run runs with now (a resume continues with it, and the
next resume is compared with it, launch/resume.py), which ``config.load_run_config``, status.py and export.py read.
Each is replaced whole (a temp file renamed over it), so a reader never sees half of one. A launch is a real run
of launch.py; a dry run or a refused config writes nothing, and a SLURM requeue is the launch it requeues. A run
directory from before launches/ existed gets its top-level files recorded as launch 001 (timed by resolved.yaml's
mtime) before the next launch writes its own.

``resume=never`` never reuses a directory that holds a run (``holds_run``): the run goes to the next free
``<name>-<n>`` beside it (``unused_sibling``), and the old directory is not touched.
"""

import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from slime_hydra.config import PROJECT_ROOT
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.durable import replace_durably

TRACKED_PACKAGES = ("slime_hydra", "torch", "transformers", "ray", "hydra-core", "omegaconf", "submitit",
                    "sglang-router", "sglang", "megatron-core", "safetensors", "math-verify", "wandb", "tensorboard")
PROVENANCE = ("resolved.yaml", "overrides.yaml", "plan.txt", "git.txt", "git.diff", "versions.json")
"""The files of one launch, in launches/<NNN>-<time>/ and (the latest launch's) at the top of the run directory."""
LAUNCHES = "launches"
RUN_MARKERS = ("resolved.yaml", "metrics.jsonl", "checkpoints")
"""A directory holding any of these holds a run (``holds_run``)."""


def run_dir_for(cfg: SlimeConfig) -> Path:
    """Absolute <output_dir>/<run_name>, with run_name defaulting to <model>-<algo>-<YYYYmmdd-HHMMSS>."""
    name = cfg.run_name or f"{cfg.model.name}-{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.output_dir).resolve() / name


def holds_run(run_dir: Path) -> bool:
    """Whether an earlier run wrote its config, metrics or checkpoints in run_dir."""
    return any((Path(run_dir) / name).exists() for name in RUN_MARKERS)


def unused_sibling(run_dir: Path) -> Path:
    """The first of <run_dir>-2, <run_dir>-3 ... that holds no run."""
    run_dir = Path(run_dir)
    number = 2
    while holds_run(run_dir.with_name(f"{run_dir.name}-{number}")):
        number += 1
    return run_dir.with_name(f"{run_dir.name}-{number}")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30)
    return out.stdout if out.returncode == 0 else ""


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def launch_folders(run_dir: Path) -> list[Path]:
    """launches/<NNN>-<time>/ of every recorded launch, first to latest."""
    folder = Path(run_dir) / LAUNCHES
    found = [p for p in folder.iterdir() if p.name.split("-", 1)[0].isdigit()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[0]))


def _new_launch_folder(run_dir: Path, stamp: str) -> Path:
    (run_dir / LAUNCHES).mkdir(exist_ok=True)
    while True:
        done = launch_folders(run_dir)
        number = int(done[-1].name.split("-", 1)[0]) + 1 if done else 1
        try:
            folder = run_dir / LAUNCHES / f"{number:03d}-{stamp}"
            folder.mkdir()
            return folder
        except FileExistsError:  # another launch took this number in the same second
            continue


def write_provenance(run_dir: Path, cfg: DictConfig, overrides: Sequence[str], plan: str) -> Path:
    """Create run_dir and record this launch (the config, the overrides, the plan as printed, the code version and
    the package versions) in a new launches/<NNN>-<time>/, and as the latest launch at the top; returns the launch's
    folder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "resolved.yaml").exists() and not (run_dir / LAUNCHES).exists():  # written before launches/
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((run_dir / "resolved.yaml").stat().st_mtime))
        earlier = _new_launch_folder(run_dir, stamp)
        for name in PROVENANCE:
            if (run_dir / name).exists():
                (earlier / name).write_text((run_dir / name).read_text())
    sha = _git("rev-parse", "HEAD").strip() or "unknown (not a git checkout)"
    status = _git("status", "--porcelain", "--untracked-files=no")
    branch = _git("rev-parse", "--abbrev-ref", "HEAD").strip()
    files = {"resolved.yaml": OmegaConf.to_yaml(cfg, resolve=True),
             "overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(list(overrides))), "plan.txt": plan,
             "git.txt": f"sha: {sha}\nbranch: {branch}\ndirty: {bool(status.strip())}\n",
             "git.diff": _git("diff", "HEAD"),
             "versions.json": json.dumps(package_versions(), indent=2) + "\n"}
    folder = _new_launch_folder(run_dir, time.strftime("%Y%m%d-%H%M%S"))
    for name, text in files.items():
        (folder / name).write_text(text)
        replace_durably(run_dir / name, text)
    return folder
