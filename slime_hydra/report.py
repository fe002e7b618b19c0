"""PNG plots of one run or several: ``python -m slime_hydra.report RUN_DIR [RUN_DIR ...] [--out DIR]``.

Reads each <run_dir>/metrics.jsonl and writes one PNG per panel that has data (reward, accuracy, learning rate, KL,
entropy, response length, phase times, the trainer-vs-engine logprob mismatch) and prints their paths. One run: to
<run_dir>/plots/; several: each panel overlays the runs (one colour per run, one line style per metric; a panel of
more metrics than line styles, as the phase times, gets a file per run: ``phase_times_<run>.png``), to ``--out``
(default ./plots). Legends sit to the right of the axes, never over a curve. A run with adaptive difficulty
(data.adaptive) also gets ``env_<task>.png`` per task (``env_<task>_<run>.png`` among several): its level (left
axis) and its pass rate, per batch and over the sampler's window (right axis), over the steps.

The KL panel shows the KL terms the objective optimizes: ``train/kl_loss`` (the KL to the reference in the loss,
algo.kl_loss_coef) and ``train/reward_kl`` (the KL in the shaped rewards, algo.kl_coef), plus ``train/ppo_kl`` (how
far the optimizer steps moved the policy from the one that sampled) when it is not 0 at every step, which it is with
one optimizer step per rollout.
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
    "learning_rate": ("train/lr", "train/critic_lr"),
    "kl": ("train/kl_loss", "train/reward_kl", "train/ppo_kl"),
    "entropy": ("train/entropy_loss",),
    "response_length": ("rollout/response_len/mean",),
    "phase_times": ("perf/*_time",),
    "mismatch": ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max",
                 "train/train_rollout_ratio_abs_dev"),
}
"""Panel name -> metric names (``*`` matches one path segment)."""

HIDDEN_WHEN_ZERO = {"train/ppo_kl"}
"""Metrics left out of their panel when 0 at every step of every run (a flat line that says nothing)."""

YLABELS = {"phase_times": "seconds", "kl": "nats per token", "learning_rate": "learning rate"}
STYLES = ("-", "--", ":", "-.")


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("/"), name.split("/")
    return len(p) == len(n) and all(a == "*" or a == b or (a.startswith("*") and b.endswith(a[1:]))
                                    for a, b in zip(p, n))


def _points(rows: list[dict], name: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[name]) for r in rows if name in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _save(fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" takes in the legend beside the axes
    plt.close(fig)
    return path


def write_report(run_dirs: Path | list[Path], out: Path | None = None) -> list[Path]:
    """The PNGs of one run (``out`` default <run_dir>/plots) or of several overlaid (``out`` default ./plots)."""
    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(r) for r in run_dirs]
    runs = {}
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        if not rows:
            raise SystemExit(f"{run_dir}/metrics.jsonl has no metrics to plot")
        runs[run_dir] = rows
    several = len(runs) > 1
    out = Path(out) if out else (Path("plots") if several else run_dirs[0] / "plots")
    out.mkdir(parents=True, exist_ok=True)
    names = sorted({k for rows in runs.values() for row in rows for k in row if k not in ("step", "time")})
    title = " vs ".join(r.name for r in runs)
    written = []
    for panel, patterns in PANELS.items():
        series = [n for n in names if any(_matches(p, n) for p in patterns)
                  and not (n in HIDDEN_WHEN_ZERO and all(r.get(n, 0.0) == 0.0 for rows in runs.values() for r in rows))]
        if not series:
            continue
        if several and len(series) > len(STYLES):  # too many lines to tell apart overlaid: one file per run
            for run_dir, rows in runs.items():
                path = out / f"{panel}_{run_dir.name}.png"
                written.append(_panel(panel, {run_dir: rows}, series, run_dir.name, path))
        else:
            written.append(_panel(panel, runs, series, title, out / f"{panel}.png"))
    for run_dir, rows in runs.items():
        run_names = {k for row in rows for k in row}
        for task in sorted({n.split("/")[1] for n in run_names if n.startswith("env/") and n.count("/") == 2
                            and n.endswith("/level")}):
            name = f"env_{task}_{run_dir.name}.png" if several else f"env_{task}.png"
            written.append(_env_panel(rows, task, run_dir, out / name))
    return written


def _panel(panel: str, runs: dict[Path, list[dict]], series: list[str], title: str, path: Path) -> Path:
    """One panel: each metric of ``series`` for each run (overlaid: a colour per run, a line style per metric)."""
    several = len(runs) > 1
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, (run_dir, rows) in enumerate(runs.items()):
        for j, name in enumerate(series):
            steps, values = _points(rows, name)
            if not steps:
                continue
            ax.plot(steps, values, label=f"{run_dir.name}: {name}" if several else name,
                    marker="." if len(steps) < 50 else None, color=colors[(k if several else j) % len(colors)],
                    linestyle=STYLES[j % len(STYLES)] if several else "-")
    ax.set_xlabel("rollout step")
    if panel in YLABELS:
        ax.set_ylabel(YLABELS[panel])
    if panel == "mismatch":
        ax.set_yscale("symlog", linthresh=1e-6)
    if panel == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_title(f"{title}: {panel.replace('_', ' ')}")
    return _save(fig, ax, path)


def _env_panel(rows: list[dict], task: str, run_dir: Path, path: Path) -> Path:
    """Level (steps, left axis) and pass rates (right axis, 0..1) of one adaptive task."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, levels = _points(rows, f"env/{task}/level")
    ax.step(steps, levels, where="post", color="black", label="level")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("level")
    ax.yaxis.get_major_locator().set_params(integer=True)
    rates = ax.twinx()
    for name, style in (("pass_rate", "-"), ("window_pass_rate", "--")):
        rates.plot(*_points(rows, f"env/{task}/{name}"), style, label=name.replace("_", " "))
    rates.set_ylim(0, 1)
    rates.set_ylabel("pass rate")
    ax.set_title(f"{run_dir.name}: {task} (adaptive difficulty)")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + rates.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0),
              borderaxespad=0.0)  # beyond the right axis' labels
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the PNGs go (default: RUN_DIR/plots for one run, ./plots for several)")
    args = parser.parse_args()
    for path in write_report(args.run_dirs, args.out):
        print(path)


if __name__ == "__main__":
    main()
