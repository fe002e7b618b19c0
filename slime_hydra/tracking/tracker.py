"""Where metrics go: <run_dir>/metrics.jsonl always, plus wandb and TensorBoard when chosen.

Metric names follow slime's where one exists: ``rollout/raw_reward``, ``rollout/response_len/mean``,
``train/pg_loss``, ``train/kl_loss``, ``train/entropy_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``,
``train/grad_norm``, ``train/lr``, ``eval/<name>/accuracy``, ``perf/<phase>_time`` (seconds) and
``perf/tokens_per_s``. One line of metrics.jsonl is ``{"step": k, "time": unix_s, <name>: value, ...}``.

Resuming: metrics.jsonl is appended to (lines of steps after the checkpoint are dropped first, so no step appears
twice; that rewrite replaces the file atomically), and wandb resumes the same run through the id kept in
<run_dir>/wandb_id.txt.
"""

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from slime_hydra.durable import replace_durably
from slime_hydra.tracking.alerts import RunAlerts
from slime_hydra.tracking.config import TrackingConfig


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config: Mapping[str, Any],
                 resume_step: int | None = None):
        """resume_step: the last step the checkpoint being resumed has trained (-1: none); rows logged after it
        are dropped. None keeps metrics.jsonl as it is."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self._file = self.path.open("a")
        self.alerts = RunAlerts()
        self._wandb = self._tensorboard = None
        if cfg.wandb:
            self._wandb = self._start_wandb(run_name, config)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step is not None else None)

    def _truncate_after(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (logged by a run that died before its next checkpoint: the rerun
        logs them again) and a last line the dying run left half-written. The file is replaced whole, and only when
        a row goes, so a crash here leaves the old history or the new one, never less."""
        if not self.path.exists():
            return
        text = self.path.read_text()
        kept = []
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the half-written last line of a killed run
                continue
            if row["step"] <= step:
                kept.append(line)
        rewritten = "".join(f"{line}\n" for line in kept)
        if rewritten != text:
            replace_durably(self.path, rewritten)

    def _start_wandb(self, run_name: str, config: Mapping[str, Any]):
        import wandb

        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        return wandb.init(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity, group=self.cfg.wandb_group,
                          tags=list(self.cfg.tags), name=run_name, id=run_id, resume="allow", mode=mode,
                          dir=str(self.run_dir), config=dict(config))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of rollout step ``step`` everywhere (every log_every_steps steps); print the warnings
        they start (tracking/alerts.py: nearly every response truncated, the same reward step after step)."""
        for warning in self.alerts.observe(step, metrics):
            print(warning, flush=True)
        if step % self.cfg.log_every_steps:
            return
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, float(value), global_step=step)
            self._tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of <run_dir>/metrics.jsonl, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
