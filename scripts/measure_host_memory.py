#!/usr/bin/env python
"""Peak host memory of a whole run (the driver and every process it starts: Ray's GCS and raylet, the trainer
ranks, the engines, the router) against the memory plan's host estimate (config/memory.py).

    python scripts/measure_host_memory.py num_steps=5 rollout.eval_every_steps=0 output_dir=/tmp/rss

runs ``python launch.py <overrides>`` and samples, every 0.5 s, the proportional set size (PSS: shared pages divided
among the processes that map them, so the plasma store and shared libraries count once) of the launched process and
all its descendants, read from /proc/<pid>/smaps_rollup. Prints the peak total, the processes at that peak by
command, and the plan's estimate for the same overrides. Linux only. Written here because it is twenty lines of
/proc reading; psutil is not a dependency of the project.
"""

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def children_of() -> dict[int, list[int]]:
    tree = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree[ppid].append(int(entry))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = children_of(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def name(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in args if a)
        return text.split("/")[-1][:60] if text else "?"
    except OSError:
        return "?"


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
        sizes = {pid: pss_bytes(pid) for pid in descendants(run.pid)}
        if sum(sizes.values()) > peak:
            peak, at_peak = sum(sizes.values()), {(pid, name(pid)): size for pid, size in sizes.items()}
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
