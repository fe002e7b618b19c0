"""The stall doctor: when a run stops making progress, say where it waits and keep every process's Python stacks.

    doctor = StallDoctor(run_dir, after_s, action, probe, where)    in the driver, once the run's processes exist
    doctor.start(); ... doctor.beat() after every step ...; doctor.stop()

Progress is a step that finished (``beat``) or a generation or reward that finished in the rollout manager
(``probe()`` returns its counter; it changes while engines produce tokens, eval included). A thread of the driver
asks every ``POLL_S`` seconds; after ``after_s`` seconds without progress it

1. writes ``<run_dir>/stall/<UTC time>/stacks.txt``: the Python stacks of the driver (``faulthandler``, every
   thread) and of the run's other Python processes on this node, by ``py-spy dump`` (installed with Ray; it reads
   a live process's stacks without stopping it): the Ray workers of the run's live actors (trainer ranks, the
   rollout manager, the engine actors: Ray titles them ``ray::<Class>.<method running>``) and the engine servers
   they started. On a node of the run's own they are below the driver; on a cluster the driver joined (RAY_ADDRESS:
   a SLURM job) they are the node's children, found through Ray's actor table (this job's actors on this node).
   Ray's daemons, its agents and the router (Rust) are left out; processes on other nodes are not reached (run
   ``py-spy dump --pid`` there);
2. writes ``report.txt`` and prints it: the driver's step and phase and the process that phase waits on (``where()``,
   e.g. "step 3, phase rollout: waiting for RolloutManager.generate_batch"), then what the rollout manager says it
   waits on (generations and reward calls in flight and for how long, engines out of service), or that it did not
   answer within ``PROBE_TIMEOUT_S``;
3. ``action="stop"``: raises ``StallError`` with the report in the driver's main thread (``_thread.interrupt_main``;
   ``Session.train`` turns the interrupt into the error, and the driver's rollout wait polls ``interrupted`` in case
   the interrupt was swallowed), so the run ends through its normal teardown;
   ``"wait"``: keeps waiting and reports again after every further ``after_s`` without progress.

Why by hand: no library watches an RL loop's progress; the stacks come from the libraries that read them
(faulthandler, py-spy), and the process tree from psutil.
"""

import _thread
import datetime
import faulthandler
import itertools
import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import psutil

ON_STALL = ("stop", "wait")
"""on_stall: end the run with the report (stop) or report and keep waiting (wait)."""
POLL_S = 5.0
"""Longest time between two progress checks (s); shorter when ``after_s`` is short."""
PROBE_TIMEOUT_S = 10.0
"""Seconds the rollout manager may take to answer a probe."""
PY_SPY_TIMEOUT_S = 30.0
"""Seconds one ``py-spy dump`` may take."""
NOT_DUMPED = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")
"""Ray's own Python processes: not the run's."""


class StallError(RuntimeError):
    """The run made no progress for the configured time; the message is the doctor's report."""


class InFlight:
    """The rollout side's calls in flight, by kind, and how many have finished: its answer to the doctor's probe."""

    def __init__(self) -> None:
        self.finished = 0
        self._started: dict[str, dict[int, float]] = {}
        self._ids = itertools.count()

    @contextmanager
    def call(self, kind: str) -> Iterator[None]:
        """Count the block as a call of ``kind`` while it runs, then as finished (an error finishes it too)."""
        token, calls = next(self._ids), self._started.setdefault(kind, {})
        calls[token] = time.monotonic()
        try:
            yield
        finally:
            del calls[token]
            self.finished += 1

    def describe(self) -> str:
        """E.g. "4 reward (never_returns) in flight, the oldest for 61 s; no generation in flight"."""
        now, parts = time.monotonic(), []
        for kind, calls in sorted(self._started.items()):
            if calls:
                parts.append(f"{len(calls)} {kind} in flight, the oldest for {now - min(calls.values()):.0f} s")
            else:
                parts.append(f"no {kind} in flight")
        return "; ".join(parts) or "nothing in flight"


class StallDoctor:
    def __init__(self, run_dir: Path, after_s: float, action: str,
                 probe: Callable[[], tuple[int, str]], where: Callable[[], str]):
        """after_s: seconds without progress before a report; action: one of ON_STALL. probe(): (the rollout
        side's progress counter, what it waits on), may raise (no answer: counted as no progress); where(): the
        driver's step, phase and the process that phase waits on."""
        if action not in ON_STALL:
            raise ValueError(f"action {action!r} is not one of {ON_STALL}")
        self.run_dir, self.after_s, self.action = Path(run_dir), after_s, action
        self.probe, self.where = probe, where
        self.verdict: Optional[str] = None
        """The report that stopped the run (action stop), for the main thread to raise."""
        self.reports: list[Path] = []
        self.interrupted = False
        """The main thread was interrupted to stop the run. Its waiting loops check this too: an interrupt that lands
        in code that swallows KeyboardInterrupt is lost (seen once in CI: the run waited on after its report)."""
        self._last_progress = time.monotonic()
        self._last_count: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-doctor", daemon=True)

    def start(self) -> "StallDoctor":
        self._last_progress = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        """A step finished."""
        self._last_progress = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=PROBE_TIMEOUT_S + PY_SPY_TIMEOUT_S)

    # ---- the watching thread -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        poll_s = min(POLL_S, max(self.after_s / 4, 0.2))
        while not self._stop.wait(poll_s):
            try:
                count, waits_on = self.probe()
            except Exception as error:  # the manager is gone or stuck: no progress from it
                count, waits_on = None, f"the rollout manager did not answer ({type(error).__name__}: {error})"
            if count is not None and count != self._last_count:
                self._last_count = count
                self._last_progress = time.monotonic()
            idle_s = time.monotonic() - self._last_progress
            if idle_s < self.after_s:
                continue
            report = self.report(idle_s, waits_on)
            if self.action == "stop":
                self.verdict = report
                _thread.interrupt_main()
                self.interrupted = True
                return
            self._last_progress = time.monotonic()  # wait: report again after another after_s

    def report(self, idle_s: float, waits_on: str) -> str:
        """Write the stacks and the report (see the module docstring); returns the report."""
        out = self.run_dir / "stall" / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        processes = dump_stacks(out / "stacks.txt")
        text = (f"stall: no step finished and no generation or reward finished for {idle_s:.0f} s "
                f"(stall_after_minutes={self.after_s / 60:g})\n"
                f"  the driver: {self.where()}\n"
                f"  the rollout manager: {waits_on}\n"
                f"  Python stacks of {processes} processes: {out / 'stacks.txt'}")
        (out / "report.txt").write_text(text + "\n")
        self.reports.append(out)
        print(text, flush=True)
        return text


def dump_stacks(path: Path) -> int:
    """The stacks of this process (every thread) and of each Python process below it (see the module docstring),
    into ``path``; returns how many processes were dumped."""
    with open(path, "w") as f:
        f.write(f"===== pid {os.getpid()}: the driver\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        count = 1
        for proc in run_processes():
            try:
                title = " ".join(proc.cmdline()).strip()
            except psutil.Error:
                continue
            if not _is_runs_python(title):
                continue
            try:
                dump = subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                      timeout=PY_SPY_TIMEOUT_S)
                stacks = dump.stdout + dump.stderr
            except (OSError, subprocess.TimeoutExpired) as error:  # no py-spy, or the process would not stop
                stacks = f"py-spy dump failed: {error}\n"
            f.write(f"\n===== pid {proc.pid}: {title[:160]}\n{stacks}")
            count += 1
    return count


def run_processes() -> list[psutil.Process]:
    """The processes below the driver, then the Ray workers of this job's live actors on this node and the processes
    below them (none twice)."""
    seen, out = {os.getpid()}, []
    roots = [psutil.Process()]
    for pid in _actor_pids_here():
        try:
            roots.append(psutil.Process(pid))
        except psutil.Error:  # ended since the table was read
            continue
    for root in roots:
        for proc in ([root] if root.pid != os.getpid() else []) + root.children(recursive=True):
            if proc.pid not in seen:
                seen.add(proc.pid)
                out.append(proc)
    return out


def _actor_pids_here() -> list[int]:
    """Worker pids of this Ray job's live actors on this node, from the GCS actor table; [] without Ray. Read with
    ``ray._private.state.actors``: Ray's public state API (``ray.util.state``) is served by the dashboard, which
    the run's clusters do not start (cluster/local_ray.py, cluster/ray_cluster.py)."""
    import ray

    if not ray.is_initialized():
        return []
    from ray._private import state

    context = ray.get_runtime_context()
    job, node = context.get_job_id(), context.get_node_id()
    return [info["Pid"] for info in state.actors(actor_state_name="ALIVE").values()
            if info["JobID"] == job and info["Address"]["NodeID"] == node and info["Pid"]]


def _is_runs_python(title: str) -> bool:
    """A Ray worker of the run (titled ``ray::...``) or an engine server."""
    if title.startswith("ray::"):
        return not title.startswith(NOT_DUMPED)
    return "slime_hydra.rollout.engines" in title or "sglang.launch_server" in title
