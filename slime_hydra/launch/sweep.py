"""Sweeps (``python launch.py -m ...``): every point validated before any starts, one run (one SLURM job) per point.

Hydra's BasicSweeper expands the sweep (``hydra.sweeper.params`` of a ``sweeps=<name>`` file plus inline
``a=1,2``) and its BasicLauncher calls ``launch()`` once per point, one after another. ``SweepCallback``
(registered in conf/config.yaml under ``hydra.callbacks``) wraps that:

- ``on_multirun_start``, before the first point: expands the same points the same way (``BasicSweeper.split_arguments``),
  composes each with ``hydra.compose`` and validates it exactly as ``launch()`` does; any problem in any point
  exits 2 listing every problem of every point, so a sweep never stops half submitted. Then it prints one row
  per point (overrides, nodes, GPUs, GPU-hours) and, for a real sweep, writes ``<sweep_dir>/sweep.json``.
- each point runs in its own run dir ``<sweep_dir>/<num>`` (Hydra's job dir, ``point_run_dir()``), so points
  never collide on a timestamped name; with ``cluster.scheduler=slurm`` each point is submitted as its own job,
  with its own shape (points may differ in nodes and GPUs), and ``launch()`` returns at once.
- ``on_multirun_end``: a real sweep fills each point's job id into the manifest (from the point's job.json);
  a dry run removes what Hydra made for it (multirun.yaml, empty job dirs), so ``-m dry_run=true`` leaves
  nothing behind.

``python -m slime_hydra.status <sweep_dir>`` then shows every point.
"""

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from slime_hydra.options import ConfigError

MANIFEST = "sweep.json"
"""The sweep manifest, in the sweep dir."""


def sweep_points(config: DictConfig) -> list[list[str]]:
    """The override list of every point, in Hydra's job order (what BasicSweeper will launch)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def point_run_dir() -> Optional[Path]:
    """In a multirun, this point's run dir (Hydra's job dir <sweep_dir>/<num>); None in a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir).resolve()


def check_point(overrides: list[str], dry_run: bool) -> tuple[list[str], Any, Any]:
    """(problems as text, SlimeConfig or None, Derived or None) of one point, validated as launch() does."""
    from hydra import compose

    from slime_hydra.config import to_config
    from slime_hydra.config.hydra_errors import as_problems
    from slime_hydra.config.preflight import preflight

    try:
        cfg = to_config(compose(config_name="config", overrides=overrides))
    except ConfigError as error:
        return [str(p) for p in error.problems], None, None
    except Exception as error:  # Hydra's / OmegaConf's own: a wrong type, an option the group lacks
        problems = as_problems(error, overrides)
        if problems is None:
            raise
        return [str(p) for p in problems], None, None
    check = preflight(cfg)
    return [str(p) for p in check.refused(dry_run)], cfg, check.derived


def _varying(points: list[list[str]]) -> list[list[str]]:
    """Each point's overrides that are not the same in every point (what tells the points apart)."""
    common = set(points[0]).intersection(*points[1:]) if len(points) > 1 else set()
    return [[o for o in point if o not in common] or point for point in points]


class SweepCallback(Callback):
    """Validate all points first; table of points; manifest; clean up after a dry run (module docstring)."""

    def __init__(self) -> None:
        self.created: list[Path] = []
        self.sweep_dir: Optional[Path] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from slime_hydra.config.derive import gpu_hours_for

        self.sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        self.created = [d for d in [self.sweep_dir, *self.sweep_dir.parents] if not d.exists()]
        dry_run = bool(config.get("dry_run"))
        points = sweep_points(config)
        labels = [" ".join(v) for v in _varying(points)]
        rows, errors = [], []
        for num, (point, label) in enumerate(zip(points, labels)):
            problems, cfg, derived = check_point(point, dry_run)
            errors += [f"point {num} ({label}): {p}" for p in problems]
            if not problems:
                slurm = cfg.cluster.scheduler == "slurm"
                hours = (gpu_hours_for(derived, cfg.cluster.time_min) if cfg.cluster.gpus_per_node else 0.0) if slurm else None
                rows.append({"num": num, "overrides": point, "label": label, "nodes": derived.nodes,
                             "gpus": derived.total_gpus if cfg.cluster.gpus_per_node else 0, "gpu_hours": hours,
                             "run_dir": str(self.sweep_dir / str(num)), "job_id": None})
        if errors:
            print(f"slime_hydra: sweep of {len(points)} points not started: {len(errors)} problem(s):\n  - "
                  + "\n  - ".join(errors), file=sys.stderr)
            raise SystemExit(ConfigError.exit_code)
        self._print(rows, dry_run)
        if not dry_run:
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            self._write({"sweep_dir": str(self.sweep_dir), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "command_overrides": list(config.hydra.overrides.task), "points": rows})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep_dir is None:
            return
        if bool(config.get("dry_run")):
            (self.sweep_dir / "multirun.yaml").unlink(missing_ok=True)  # Hydra's record of a sweep that never ran
            for path in sorted(self.sweep_dir.glob("*"), reverse=True):
                if path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
            for path in self.created:  # deepest first
                if path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
            return
        manifest = json.loads((self.sweep_dir / MANIFEST).read_text())
        for point in manifest["points"]:
            job = Path(point["run_dir"]) / "job.json"
            if job.exists():
                point["job_id"] = json.loads(job.read_text())["job_id"]
        self._write(manifest)
        Console(soft_wrap=True).print(f"sweep of {len(manifest['points'])} points: {self.sweep_dir}\n"
                                      f"  status: python -m slime_hydra.status {self.sweep_dir}", markup=False)

    def _write(self, manifest: dict) -> None:
        assert self.sweep_dir is not None
        (self.sweep_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    @staticmethod
    def _print(rows: list[dict], dry_run: bool) -> None:
        table = Table(title=f"Sweep: {len(rows)} points" + (" (dry run: nothing is submitted)" if dry_run else ""))
        for column in ("#", "overrides", "nodes", "GPUs", "GPU-hours"):
            table.add_column(column, justify="left" if column == "overrides" else "right")
        for r in rows:
            hours = "-" if r["gpu_hours"] is None else f"{r['gpu_hours']:.1f}"
            table.add_row(str(r["num"]), r["label"], str(r["nodes"]), str(r["gpus"]), hours)
        if len(rows) > 1 and any(r["gpu_hours"] is not None for r in rows):
            table.add_row("", "total", "", "", f"{sum(r['gpu_hours'] or 0 for r in rows):.1f}")
        Console(soft_wrap=True).print(table)
