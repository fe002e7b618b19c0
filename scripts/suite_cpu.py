"""Where the test suite's time and CPU go: a pytest plugin that writes, per test, its wall seconds and the machine's
busy CPU seconds over them, then sums both per directory.

    python -m pytest -p scripts.suite_cpu --suite-cpu=/tmp/suite_cpu.jsonl ...
    python scripts/suite_cpu.py /tmp/suite_cpu.jsonl          # per directory: tests, wall s, CPU s, cores busy

The CPU is the whole machine's (/proc/stat: user + nice + system + irq + softirq + steal), not the pytest
process's: a test's runs spend most of theirs in Ray's daemons and the run's own processes, which no per-process
clock of pytest sees. So measure on a quiet machine. "cores busy" = CPU s / wall s: a directory near 1 on a 2-core
machine leaves a core idle, which parallel workers could use; one near 2 can only get faster by doing less.
Hand-written: pytest's --durations and junit report wall time only.
"""

import collections
import json
import os
import sys
import time

import pytest

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system (idle iowait) irq softirq steal


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks[i] for i in BUSY_FIELDS) / TICKS_PER_S


def pytest_addoption(parser):
    parser.addoption("--suite-cpu", default=None, help="JSONL file for each test's wall and machine CPU seconds")


def _phase_record(item, when: str, started: tuple[float, float]):
    path = item.config.getoption("--suite-cpu")
    if path:
        wall, cpu = time.monotonic() - started[0], busy_cpu_s() - started[1]
        with open(path, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "when": when, "wall_s": round(wall, 3),
                                "cpu_s": round(cpu, 3)}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    started = (time.monotonic(), busy_cpu_s())
    yield
    _phase_record(item, "setup", started)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    started = (time.monotonic(), busy_cpu_s())
    yield
    _phase_record(item, "call", started)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    started = (time.monotonic(), busy_cpu_s())
    yield
    _phase_record(item, "teardown", started)


def summary(path: str) -> str:
    """Per directory (tests/<dir>, or the file for top-level tests): tests, wall s, CPU s, cores busy; then the 30
    tests of most CPU."""
    wall, cpu, tests = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    per_test = collections.Counter()
    for line in open(path):
        row = json.loads(line)
        parts = row["test"].split("::")[0].split("/")
        key = "/".join(parts[:2]) if len(parts) > 2 else parts[-1]
        wall[key] += row["wall_s"]
        cpu[key] += row["cpu_s"]
        tests[key].add(row["test"])
        per_test[row["test"]] += row["cpu_s"]
    lines = ["| directory | tests | wall s | CPU s | cores busy |", "|---|---|---|---|---|"]
    for key, w in wall.most_common():
        lines.append(f"| {key} | {len(tests[key])} | {w:.0f} | {cpu[key]:.0f} | {cpu[key] / max(w, 1e-9):.2f} |")
    total_w, total_c = sum(wall.values()), sum(cpu.values())
    lines.append(f"| **all** | {sum(map(len, tests.values()))} | {total_w:.0f} | {total_c:.0f} | "
                 f"{total_c / max(total_w, 1e-9):.2f} |")
    lines += ["", "CPU s, the 30 tests of most:"] + [f"{c:8.1f}  {t}" for t, c in per_test.most_common(30)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
