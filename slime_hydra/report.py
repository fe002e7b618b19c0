"""PNG plots of a run: ``python -m slime_hydra.report RUN_DIR [--out DIR]``.

Reads <run_dir>/metrics.jsonl and writes one PNG per panel that has data (reward, accuracy, KL, entropy, response
length, phase times, the trainer-vs-engine logprob mismatch) to <run_dir>/plots/ (or --out), and prints their paths.
A run with adaptive difficulty (data.adaptive) also gets ``env_<task>.png`` per task: its level (left axis) and its
pass rate, per batch and over the sampler's window (right axis), over the steps.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slime_hydra.tracking.tracker import read_metrics  # noqa: E402

PANELS = {
    "reward": ("rollout/raw_reward",),
    "accuracy": ("eval/*/accuracy",),
    "kl": ("train/ppo_kl", "train/kl_loss"),
    "entropy": ("train/entropy_loss",),
    "response_length": ("rollout/response_len/mean",),
    "phase_times": ("perf/*_time",),
    "mismatch": ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max",
                 "train/train_rollout_ratio_abs_dev"),
}
"""Panel name -> metric names (``*`` matches one path segment)."""


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("/"), name.split("/")
    return len(p) == len(n) and all(a == "*" or a == b or (a.startswith("*") and b.endswith(a[1:]))
                                    for a, b in zip(p, n))


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no metrics to plot")
    out = Path(out) if out else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    names = sorted({k for row in rows for k in row if k not in ("step", "time")})
    written = []
    for panel, patterns in PANELS.items():
        series = [n for n in names if any(_matches(p, n) for p in patterns)]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in series:
            points = [(r["step"], r[name]) for r in rows if name in r]
            ax.plot([s for s, _ in points], [v for _, v in points], label=name, marker="." if len(points) < 50 else None)
        ax.set_xlabel("rollout step")
        if panel == "phase_times":
            ax.set_ylabel("seconds")
        if panel == "mismatch":
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(f"{Path(run_dir).name}: {panel.replace('_', ' ')}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for task in sorted({n.split("/")[1] for n in names if n.startswith("env/") and n.count("/") == 2
                        and n.endswith("/level")}):
        written.append(_env_panel(rows, task, run_dir, out))
    return written


def _env_panel(rows: list[dict], task: str, run_dir: Path, out: Path) -> Path:
    """Level (steps, left axis) and pass rates (right axis, 0..1) of one adaptive task."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    points = [(r["step"], r[f"env/{task}/level"]) for r in rows if f"env/{task}/level" in r]
    ax.step([s for s, _ in points], [v for _, v in points], where="post", color="black", label="level")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("level")
    ax.yaxis.get_major_locator().set_params(integer=True)
    rates = ax.twinx()
    for name, style in (("pass_rate", "-"), ("window_pass_rate", "--")):
        key = f"env/{task}/{name}"
        series = [(r["step"], r[key]) for r in rows if key in r]
        rates.plot([s for s, _ in series], [v for _, v in series], style, label=name.replace("_", " "))
    rates.set_ylim(0, 1)
    rates.set_ylabel("pass rate")
    ax.set_title(f"{Path(run_dir).name}: {task} (adaptive difficulty)")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + rates.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / f"env_{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for path in write_report(args.run_dir, args.out):
        print(path)


if __name__ == "__main__":
    main()
