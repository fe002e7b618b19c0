"""The CPU default beside a busy loop, against the same run on a quiet machine (docs/benchmarks.md, "A busy machine").

    python scripts/bench_busy_machine.py [--steps 60] [--busy 1] [--root CHECKOUT]

Runs ``python launch.py num_steps=N`` (the CPU default: the tiny model learning addition) twice: quiet, then with
``--busy`` processes spinning ``while True: pass`` beside it. Each run has a fresh model cache, so the SFT warm start
is part of it. Prints, per run: the wall time, the warm start's seconds (its own log line), and the train and rollout
phases' seconds per step (metrics.jsonl: mean, median, min over all steps), and the ratio busy / quiet.
``--root`` runs another checkout's launch.py (e.g. a worktree of the commit before cores.py, for the old figures).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(root: Path, steps: int, busy: int, out: Path) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    env = {**os.environ, "SLIME_HYDRA_CACHE": str(out / "cache"), "PYTHONPATH": str(root)}
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(root / "launch.py"), f"num_steps={steps}", f"output_dir={out}",
                               "run_name=r", "tracking.progress=false", "export_at_end=false"],
                              env=env, capture_output=True, text=True, cwd=out)
    finally:
        for spinner in spinners:
            spinner.kill()
    wall = time.monotonic() - start
    if done.returncode:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    warm = re.search(r"SFT warm start: .* in (\d+) s", done.stdout)
    rows = [json.loads(line) for line in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    phases = {}
    for phase in ("train", "rollout"):
        values = [row[f"perf/{phase}_time"] for row in rows if f"perf/{phase}_time" in row]
        phases[phase] = (statistics.fmean(values), statistics.median(values), min(values))
    return {"wall_s": wall, "warm_start_s": float(warm.group(1)) if warm else None, "phases": phases,
            "accuracy": rows[-1].get("eval/addition/accuracy", rows[-1].get("rollout/accuracy"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the busy run")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose launch.py runs")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.steps} steps; {args.root}", flush=True)
    results = {}
    for name, busy in (("quiet", 0), ("busy", args.busy)):
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = result = one_run(args.root, args.steps, busy, Path(tmp))
        phases = "; ".join(f"{p} {m:.2f} / {md:.2f} / {mn:.2f} s" for p, (m, md, mn) in result["phases"].items())
        print(f"{name:5s} ({busy} busy loop(s)): {result['wall_s']:.0f} s in all, warm start "
              f"{result['warm_start_s']} s; per step (mean / median / min) {phases}; final accuracy "
              f"{result['accuracy']}", flush=True)
    print(f"busy / quiet: {results['busy']['wall_s'] / results['quiet']['wall_s']:.2f}x in all")


if __name__ == "__main__":
    main()
