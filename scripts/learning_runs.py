"""Several runs of ``launch.py`` side by side, and what each learned: ``python scripts/learning_runs.py``.

    python scripts/learning_runs.py --out runs/seeds --run cpu1 "seed=1" --run cpu2 "seed=2" [--parallel 2]
    python scripts/learning_runs.py --summarize runs/seeds            # the table again, from the run dirs

Each ``--run NAME "OVERRIDES"`` is one ``python launch.py output_dir=OUT run_name=NAME OVERRIDES``; at most
``--parallel`` run at once (the rest wait), each with its log in OUT/NAME.log. ``--time-limit-s`` stops the runs
still going at that point with SIGTERM (each checkpoints and exits; SIGKILL 90 s later) and summarizes what they
logged. At the end (or with --summarize) one
row per run from its metrics.jsonl: held-out accuracy at step 0, its peak and its last value, the sampled reward of
the first and last step, the train-vs-rollout logprob mismatch (mean over steps of the per-step mean, and the
largest per-step max), the median step time and the run's wall time. ``--json FILE`` writes the rows as JSON too.
Used for the learning checks in docs/benchmarks.md (CPU and GPU, several seeds).
"""

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], v) for r in rows for k, v in r.items()  # the set's accuracy, not its per-level ones
             if k.startswith("eval/") and k.endswith("/accuracy") and "/level_" not in k]
    train = [r for r in rows if "rollout/raw_reward" in r]
    diff = [r["train/train_rollout_logprob_abs_diff"] for r in train if "train/train_rollout_logprob_abs_diff" in r]
    diff_max = [r["train/train_rollout_logprob_abs_diff_max"] for r in train
                if "train/train_rollout_logprob_abs_diff_max" in r]
    steps = [r["perf/step_time"] for r in train if "perf/step_time" in r]
    return {
        "run": run_dir.name, "steps": len(train),
        "eval_first": evals[0][1] if evals else None, "eval_peak": max(v for _, v in evals) if evals else None,
        "eval_last": evals[-1][1] if evals else None, "eval_last_step": evals[-1][0] if evals else None,
        "reward_first": train[0]["rollout/raw_reward"] if train else None,
        "reward_last": train[-1]["rollout/raw_reward"] if train else None,
        "mismatch_mean": statistics.fmean(diff) if diff else None, "mismatch_max": max(diff_max) if diff_max else None,
        "step_s_median": statistics.median(steps) if steps else None,
        "wall_s": rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else None,
    }


def table(rows: list[dict]) -> str:
    def fmt(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else (f"{v:.3g}" if isinstance(v, float) else str(v))

    head = "| run | steps | eval step 0 | peak | last (step) | reward first -> last | mismatch mean / max | step s | wall s |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['run']} | {r['steps']} | {fmt(r['eval_first'], True)} | {fmt(r['eval_peak'], True)} | "
                     f"{fmt(r['eval_last'], True)} ({r['eval_last_step']}) | {fmt(r['reward_first'])} -> "
                     f"{fmt(r['reward_last'])} | {fmt(r['mismatch_mean'])} / {fmt(r['mismatch_max'])} | "
                     f"{fmt(r['step_s_median'])} | {fmt(r['wall_s'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output_dir of the runs")
    parser.add_argument("--run", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"))
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--time-limit-s", type=float, default=None)
    parser.add_argument("--summarize", type=Path, help="only print the table of the runs under this directory")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.summarize:
        out, names = args.summarize, sorted(p.parent.name for p in args.summarize.glob("*/metrics.jsonl"))
    else:
        out, names = args.out.resolve(), [name for name, _ in args.run]
        out.mkdir(parents=True, exist_ok=True)
        waiting, running = list(args.run), []
        deadline = time.monotonic() + args.time_limit_s if args.time_limit_s else None
        while waiting or running:
            if deadline is not None and time.monotonic() > deadline:
                waiting = []
                for name, proc, _ in running:
                    print(f"time limit: stopping {name}", flush=True)
                    proc.send_signal(signal.SIGTERM)
                for name, proc, _ in running:
                    try:
                        proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                deadline = None
            while waiting and len(running) < args.parallel:
                name, overrides = waiting.pop(0)
                cmd = [sys.executable, str(ROOT / "launch.py"), f"output_dir={out}", f"run_name={name}",
                       "tracking.progress=false", *shlex.split(overrides)]
                log = open(out / f"{name}.log", "w")
                print(f"start {name}: {shlex.join(cmd[1:])}", flush=True)
                running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
            time.sleep(2)
            for item in list(running):
                name, proc, log = item
                if proc.poll() is not None:
                    log.close()
                    running.remove(item)
                    print(f"end {name}: exit {proc.returncode}", flush=True)
    rows = [summarize(out / n) for n in names if (out / n / "metrics.jsonl").exists()]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
