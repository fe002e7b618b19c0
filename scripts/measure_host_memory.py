#!/usr/bin/env python
"""Peak host memory of a whole run (the driver and every process it starts: Ray's GCS and raylet, the trainer
ranks, the engines, the router) against the memory plan's host estimate (config/memory.py).

    python scripts/measure_host_memory.py num_steps=5 rollout.eval_every_steps=0 output_dir=/tmp/rss

runs ``python launch.py <overrides>`` and samples, every 0.5 s, the proportional set size (PSS: shared pages divided
among the processes that map them, so the plasma store and shared libraries count once) of the launched process and
all its descendants (psutil). Prints the peak total, the processes at that peak by command, and the plan's
estimate for the same overrides. Linux only (PSS).
"""

import collections
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def processes(root: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(root)
        return [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def pss_bytes(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss
    except psutil.Error:  # gone, or not ours
        return 0


def name(proc: psutil.Process) -> str:
    try:
        text = " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
    return text.split("/")[-1][:60] if text else "?"


def main() -> None:
    overrides = sys.argv[1:]
    from slime_hydra.config import compose, to_config
    from slime_hydra.config.derive import derive
    from slime_hydra.config.memory import GiB, plan_memory

    cfg = to_config(compose(overrides))
    host = plan_memory(cfg, derive(cfg)).host
    run = subprocess.Popen([sys.executable, "launch.py", *overrides, "tracking.progress=false"], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, at_peak = 0, {}
    while run.poll() is None:
        sizes = {proc: pss_bytes(proc) for proc in processes(run.pid)}
        if sum(sizes.values()) > peak:
            peak, at_peak = sum(sizes.values()), {(proc.pid, name(proc)): size for proc, size in sizes.items()}
        time.sleep(0.5)
    by_command = collections.Counter()
    for (_, command), size in at_peak.items():
        by_command[command] += size
    print(f"exit code {run.returncode}; peak PSS {peak / GiB:.2f} GiB over {len(at_peak)} processes")
    for command, size in by_command.most_common(12):
        print(f"  {size / GiB:6.2f} GiB  {command}")
    print(f"plan: {host.line()}; estimate / measured = {host.total / max(peak, 1):.2f}")


if __name__ == "__main__":
    main()
