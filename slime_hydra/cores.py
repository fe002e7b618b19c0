"""The CPU cores a run's torch processes may use: those no other program keeps busy when the run starts.

    usable_cores() -> int        cores of this process's affinity that were idle over a 0.5 s sample (at least 1)

A torch op on a CPU runs on a team of OpenMP threads that meet at a barrier when it ends. When another program keeps
one of the cores busy, the team's thread on that core gets a time slice only now and then, and every op waits for
it: one busy loop beside the CPU default on the 2-core machine made its train phase 6.8-7.8 s a step instead of
0.5-0.8 s with 2 threads per process (issue 45). A team as large as the idle cores runs at full speed on them
instead, so the trainer and the engines size their teams by this count (the warm start does not: its model
must not depend on the load, model/warm_start.WARM_START_THREADS). It is sampled once per
process (``functools.cache``): a program that starts later is not seen.
Written here because psutil gives the per-core load but no rule for a thread count.
"""

import functools
import os

import psutil

SAMPLE_S = 0.5
"""How long the cores' load is sampled."""
BUSY_PERCENT = 50.0
"""A core busier than this over the sample is taken."""


@functools.cache
def usable_cores() -> int:
    allowed = sorted(os.sched_getaffinity(0))
    load = psutil.cpu_percent(interval=SAMPLE_S, percpu=True)
    busy = sum(1 for cpu in allowed if cpu < len(load) and load[cpu] > BUSY_PERCENT)
    return max(1, len(allowed) - busy)
