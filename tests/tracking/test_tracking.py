"""metrics.jsonl, wandb (offline), TensorBoard and the PNG report, read back and checked."""

import subprocess
import sys

import pytest

from slime_hydra.tracking.config import TrackingConfig
from slime_hydra.tracking.progress import summary
from slime_hydra.tracking.tracker import Tracker, read_metrics


def _log_steps(tracker, steps):
    for k in steps:
        tracker.log(k, {"rollout/raw_reward": 0.1 * k, "eval/addition/accuracy": 0.05 * k, "train/ppo_kl": 0.0,
                        "train/entropy_loss": 1.0 - 0.1 * k, "rollout/response_len/mean": 3.0,
                        "perf/rollout_time": 1.5, "perf/train_time": 2.0,
                        "train/train_rollout_logprob_abs_diff": 1e-3 * k, "train/train_rollout_logprob_abs_diff_max": 0.1})


def test_metrics_jsonl_and_resume_never_repeats_a_step(tmp_path):
    tracker = Tracker(TrackingConfig(), tmp_path, "run", {})
    _log_steps(tracker, range(5))
    tracker.close()
    # the run crashed after step 4 but its last checkpoint is step 2: steps 3-4 are logged again after resume
    tracker = Tracker(TrackingConfig(), tmp_path, "run", {}, resume_step=2)
    _log_steps(tracker, range(3, 6))
    tracker.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[4]["rollout/raw_reward"] == pytest.approx(0.4)


def test_a_rerun_drops_a_half_written_row_and_everything_after_its_checkpoint(tmp_path):
    tracker = Tracker(TrackingConfig(), tmp_path, "run", {})
    _log_steps(tracker, range(3))
    tracker.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rollout/raw_')  # the driver was killed mid-write
    tracker = Tracker(TrackingConfig(), tmp_path, "run", {}, resume_step=1)
    _log_steps(tracker, [2])
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    # died before its first checkpoint: the rerun starts from step 0 and keeps none of the old rows
    Tracker(TrackingConfig(), tmp_path, "run", {}, resume_step=-1).close()
    assert read_metrics(tmp_path) == []


def test_log_every_steps(tmp_path):
    tracker = Tracker(TrackingConfig(log_every_steps=2), tmp_path, "run", {})
    _log_steps(tracker, range(5))
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 2, 4]


def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(TrackingConfig(tensorboard=True), tmp_path, "run", {})
    _log_steps(tracker, range(4))
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    values = [(e.step, round(e.value, 6)) for e in acc.Scalars("rollout/raw_reward")]
    assert values == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]


def test_wandb_offline_run_is_written_and_resumable(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(TrackingConfig(wandb=True), tmp_path, "run", {"lr": 1e-4})
    _log_steps(tracker, range(3))
    tracker.close()
    run_id = (tmp_path / "wandb_id.txt").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "offline run files"
    tracker = Tracker(TrackingConfig(wandb=True), tmp_path, "run", {}, resume_step=2)
    assert (tmp_path / "wandb_id.txt").read_text() == run_id  # resumes the same wandb run
    tracker.close()


def test_report_writes_one_png_per_panel(tmp_path):
    tracker = Tracker(TrackingConfig(), tmp_path, "run", {})
    _log_steps(tracker, range(6))
    tracker.close()
    out = subprocess.run([sys.executable, "-m", "slime_hydra.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    names = sorted(p.stem for p in (tmp_path / "plots").glob("*.png"))
    # no kl panel: its only series, train/ppo_kl, is 0 at every step (one optimizer step a rollout)
    assert names == ["accuracy", "entropy", "mismatch", "phase_times", "response_length", "reward"]
    assert all(p.stat().st_size > 5000 for p in (tmp_path / "plots").glob("*.png"))
    assert str(tmp_path / "plots" / "reward.png") in out.stdout


def test_report_overlays_runs_with_the_learning_rate_the_optimized_kl_and_legends_beside_the_axes(tmp_path,
                                                                                                  monkeypatch):
    import matplotlib.pyplot as plt

    from slime_hydra import report

    for name, lr in (("a", 1e-4), ("b", 3e-4)):
        tracker = Tracker(TrackingConfig(), tmp_path / name, name, {})
        for k in range(1, 6):
            tracker.log(k, {"rollout/raw_reward": 0.1 * k, "train/lr": lr * (1 - k / 10), "train/ppo_kl": 0.0,
                            "train/kl_loss": 0.01 * k})
        tracker.close()
    drawn, save = [], report._save
    monkeypatch.setattr(report, "_save", lambda fig, ax, path: (drawn.append((fig, ax, path)), save(fig, ax, path))[1])
    written = report.write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "both")
    assert [p.name for p in written] == ["reward.png", "learning_rate.png", "kl.png"]
    by_panel = {path.stem: ax for _, ax, path in drawn}
    assert [line.get_label() for line in by_panel["kl"].get_lines()] == ["a: train/kl_loss", "b: train/kl_loss"]
    lr = {line.get_label(): list(line.get_ydata()) for line in by_panel["learning_rate"].get_lines()}
    assert lr["b: train/lr"] == pytest.approx([3e-4 * (1 - k / 10) for k in range(1, 6)])
    for fig, ax, _ in drawn:  # every legend lies right of the axes, clear of the curves
        fig.canvas.draw()
        legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 > axes.x1, (legend, axes)
    plt.close("all")


def test_progress_summary_line():
    line = summary({"rollout/raw_reward": 0.5, "eval/addition/accuracy": 0.72, "perf/tokens_per_s": 1234.4,
                    "perf/step_tokens_per_s": 371.6, "perf/rollout_time": 1.25, "perf/train_time": 2.0,
                    "perf/weight_sync_time": 0.05})
    assert line == ("reward 0.500 | addition 72.0% | generate 1234 tok/s | step 372 tok/s | "
                    "rollout 1.2s train 2.0s weight_sync 0.1s")
    small = {"rollout/raw_reward": 0.5, "train/train_rollout_logprob_abs_diff": 2e-6}
    assert summary(small) == "reward 0.500"  # the CPU path's agreement is not news
    large = {"rollout/raw_reward": 0.5, "train/train_rollout_logprob_abs_diff": 0.0123,
             "train/train_rollout_logprob_abs_diff_max": 0.41}
    assert summary(large) == "reward 0.500 | mismatch 0.012 (max 0.41)"


def test_progress_without_a_terminal_prints_one_plain_line_per_step():
    import io

    from rich.console import Console

    from slime_hydra.tracking.progress import ProgressView

    out = io.StringIO()
    with ProgressView(3, console=Console(file=out, force_terminal=False)) as view:
        view.before_training({"eval/addition/accuracy": 0.25, "perf/eval_time": 2.0})
        for step in range(1, 4):  # 1-based, as metrics.jsonl's rows and the checkpoints
            view.update(step, {"rollout/raw_reward": 0.25 * step, "perf/train_time": 1.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("before training 0:00 | addition 25.0% | eval 2.0s")
    assert [line.split(" ")[1] for line in lines[1:]] == ["1/3", "2/3", "3/3"]
    assert lines[-1].endswith("| reward 0.750 | train 1.0s")


def test_the_step_rate_is_the_tokens_over_the_whole_step():
    from slime_hydra.tracking.phases import StepTimer

    timer = StepTimer()
    timer.start -= 4.0  # a step that began 4 s ago
    rate = timer.metrics(tokens=1000.0)["perf/step_tokens_per_s"]
    assert 1000.0 / 4.1 < rate <= 1000.0 / 4.0
    assert "perf/step_tokens_per_s" not in StepTimer().metrics()
