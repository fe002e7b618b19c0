"""The terminal view of a run: a rich progress bar whose description carries the latest step's numbers."""

from typing import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slime_hydra.tracking.phases import PHASES

MISMATCH_SHOWN = 1e-3
"""train/train_rollout_logprob_abs_diff (nats per token) above which the progress line shows it: the CPU fp32 path
agrees to ~1e-6, so a larger gap means trainer and engine sample from different distributions (algo/losses.py)."""


def summary(metrics: Mapping[str, float]) -> str:
    """One line: reward, eval accuracy, the train-vs-rollout logprob mismatch when large, tokens/s and the time of
    each phase."""
    parts = []
    if "rollout/raw_reward" in metrics:
        parts.append(f"reward {metrics['rollout/raw_reward']:.3f}")
    accuracy = [f"{k.split('/')[1]} {v:.1%}" for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/accuracy")]
    parts += accuracy
    mismatch = metrics.get("train/train_rollout_logprob_abs_diff", 0.0)
    if mismatch > MISMATCH_SHOWN:
        parts.append(f"mismatch {mismatch:.2g} (max {metrics.get('train/train_rollout_logprob_abs_diff_max', 0):.2g})")
    if "perf/tokens_per_s" in metrics:
        parts.append(f"{metrics['perf/tokens_per_s']:.0f} tok/s")
    times = [f"{p} {metrics[f'perf/{p}_time']:.1f}s" for p in PHASES if f"perf/{p}_time" in metrics]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)


class ProgressView:
    def __init__(self, total_steps: int, first_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.description}"), console=Console(stderr=True), disable=not enabled)
        self._task = self._progress.add_task("", total=total_steps, completed=first_step)

    def __enter__(self) -> "ProgressView":
        self._progress.start()
        return self

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        self._progress.update(self._task, completed=step + 1, description=summary(metrics))

    def __exit__(self, *exc) -> None:
        self._progress.stop()
