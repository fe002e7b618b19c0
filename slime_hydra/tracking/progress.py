"""The terminal view of a run: a rich progress bar whose description carries the latest step's numbers."""

import time
from typing import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slime_hydra.tracking.phases import PHASES

MISMATCH_SHOWN = 1e-3
"""train/train_rollout_logprob_abs_diff (nats per token) above which the progress line shows it: the CPU fp32 path
agrees to ~1e-6, so a larger gap means trainer and engine sample from different distributions (algo/losses.py)."""


def summary(metrics: Mapping[str, float]) -> str:
    """One line: reward, eval accuracy, the train-vs-rollout logprob mismatch when large, the generation's and the
    step's tokens/s, and the time of each phase."""
    parts = []
    if "rollout/raw_reward" in metrics:
        parts.append(f"reward {metrics['rollout/raw_reward']:.3f}")
    accuracy = [f"{k.split('/')[1]} {v:.1%}" for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/accuracy")]
    parts += accuracy
    mismatch = metrics.get("train/train_rollout_logprob_abs_diff", 0.0)
    if mismatch > MISMATCH_SHOWN:
        parts.append(f"mismatch {mismatch:.2g} (max {metrics.get('train/train_rollout_logprob_abs_diff_max', 0):.2g})")
    if "perf/tokens_per_s" in metrics:  # the rollout manager's: tokens / the batch's generation time
        parts.append(f"generate {metrics['perf/tokens_per_s']:.0f} tok/s")
    if "perf/step_tokens_per_s" in metrics:  # tokens / the whole step's time (tracking/phases.py)
        parts.append(f"step {metrics['perf/step_tokens_per_s']:.0f} tok/s")
    times = [f"{p} {metrics[f'perf/{p}_time']:.1f}s" for p in PHASES if f"perf/{p}_time" in metrics]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)


class ProgressView:
    """On a terminal, a live bar; elsewhere (SLURM, nohup, CI: stderr is not a terminal) one plain line per step,
    ``step k/N elapsed | summary`` (k from 1), flushed, so a log shows progress while the run goes on; the eval
    before training gets a line ``before training elapsed | summary``."""

    def __init__(self, total_steps: int, first_step: int = 0, enabled: bool = True, console: Console | None = None):
        self.enabled, self.total = enabled, total_steps
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.description}"), console=self.console, disable=not self.live)
        self._task = self._progress.add_task("", total=total_steps, completed=first_step)
        self._start = time.monotonic()

    def __enter__(self) -> "ProgressView":
        self._progress.start()
        return self

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """The metrics of the step-th step (1-based, as in metrics.jsonl and the checkpoint names)."""
        if self.live:
            self._progress.update(self._task, completed=step, description=summary(metrics))
        elif self.enabled:
            self._line(f"step {step}/{self.total}", metrics)

    def before_training(self, metrics: Mapping[str, float]) -> None:
        """The eval before the first step (row 0 of metrics.jsonl), on a line of its own."""
        if self.live:
            self.console.print(f"before training | {summary(metrics)}", markup=False, highlight=False)
        elif self.enabled:
            self._line("before training", metrics)

    def _line(self, label: str, metrics: Mapping[str, float]) -> None:
        elapsed = int(time.monotonic() - self._start)
        print(f"{label} {elapsed // 60}:{elapsed % 60:02d} | {summary(metrics)}", file=self.console.file, flush=True)

    def __exit__(self, *exc) -> None:
        self._progress.stop()
