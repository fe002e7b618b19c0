"""The run directory and its provenance: what ran, from which code, with which packages.

    <output_dir>/<run_name>/
      resolved.yaml    the composed config with every interpolation resolved
      overrides.yaml   the command-line overrides, as typed
      git.txt          commit sha, branch, and whether the tree was dirty
      git.diff         uncommitted changes to tracked files (empty when clean)
      versions.json    python and the versions of the packages that shape results
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

TRACKED_PACKAGES = ("slime_hydra", "torch", "transformers", "ray", "hydra-core", "omegaconf", "submitit",
                    "sglang-router", "sglang", "megatron-core", "safetensors", "math-verify", "wandb", "tensorboard")


def run_dir_for(cfg: SlimeConfig) -> Path:
    """Absolute <output_dir>/<run_name>, with run_name defaulting to <model>-<algo>-<YYYYmmdd-HHMMSS>."""
    name = cfg.run_name or f"{cfg.model.name}-{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.output_dir).resolve() / name


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


def write_provenance(run_dir: Path, cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Create run_dir and record the config, the overrides, the code version and the package versions."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    sha = _git("rev-parse", "HEAD").strip() or "unknown (not a git checkout)"
    status = _git("status", "--porcelain", "--untracked-files=no")
    branch = _git("rev-parse", "--abbrev-ref", "HEAD").strip()
    (run_dir / "git.txt").write_text(f"sha: {sha}\nbranch: {branch}\ndirty: {bool(status.strip())}\n")
    (run_dir / "git.diff").write_text(_git("diff", "HEAD"))
    (run_dir / "versions.json").write_text(json.dumps(package_versions(), indent=2) + "\n")
