"""The Ray node of a run on one machine (no RAY_ADDRESS), in a session of its own.

``ray.init()`` would start Ray's GCS and raylet as children of the driver, in its process group: a signal to the
whole group (``timeout``, a service manager, Ctrl-C in some shells, ``kill -- -PGID``) then reaches them at the same
moment as the driver and kills them before the driver can write its checkpoint. Started here instead:
``ray start --head --block`` in a new session (so the group signal reaches only the driver, whose handler
checkpoints at the next step boundary and shuts everything down in order), tied to the driver
(``lifetime.tied_to_parent``: if the driver is killed, ``ray start`` and its whole group are too), then
the driver connects with ``ray.init(address=...)``. Its temp dir is private (``/tmp/ray_sh_*``), so a plain
``ray.init()`` elsewhere on the machine does not attach to this run's node. ``stop`` ends the node's process group
(SIGTERM, SIGKILL after a grace period, a bounded wait at every step), copies Ray's logs (each actor's stdout and
stderr, the daemons') into the run's ``logs/ray`` and removes the temp dir; the temp dirs of drivers that were
killed (so never stopped their node) are removed by the next run's ``start``.
"""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from slime_hydra.lifetime import tied_to_parent
from slime_hydra.net import answers, free_port

START_TIMEOUT_S = 120.0
"""Seconds ``ray start`` may take to open its GCS port."""
STARTED_LINE = "Ray runtime started."
"""What ``ray start`` (2.60) prints once its GCS, raylet and agents are up. ``start`` returns only then: a driver that
connects as soon as the GCS port opens finds no node yet, and ray.init's own waits for it (1 s, then 2 s polls for
the session) cost ~3 s more per run than the node takes to come up (measured on the CPU machine)."""
TERM_GRACE_S = 0.5
"""Seconds the node's process group gets between SIGTERM and SIGKILL. Ray's Python daemons exit within ~20 ms of
the SIGTERM; the raylet, the GCS and the autoscaler's monitor do not exit on it, and ``ray start`` gives each of them
1 s in turn before it SIGKILLs it (3.3 s a stop on the CPU machine): they get the SIGKILL from us sooner."""
STOP_GRACE_S = 10.0
"""Seconds ``ray start`` gets to exit after the SIGKILL of its group."""
TEMP_PREFIX = "ray_sh_"
OWNER_FILE = "driver.pid"
"""In the temp dir: the pid of the driver that started the node (a dir whose driver is gone is stale)."""


NO_DRAIN_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
"""For ``ray start``: on SIGTERM, Ray (2.60, ``_private/node.py``) marks its node draining and waits up to 30 s for
the leases to come back before it stops its processes. Our nodes are stopped after the driver has ended its
actors (nothing to drain), and the wait made every stop run into the SIGKILL grace period (10 s a run, measured on
the CPU machine)."""

NORMAL_PRIORITY_ENV = {"RAY_worker_niceness": "0"}
"""For ``ray start``: Ray (2.60) runs its worker processes at nice 15, under its daemons. A run's workers are its
trainer ranks, engines and rollout manager, the run itself: at nice 15, any other program on the machine at nice 0
takes the CPU from them (the test suite beside one busy loop made ~8% of its tests in 26 minutes,
docs/benchmarks.md)."""

NO_PRESTART_ENV = {"RAY_prestart_worker_first_driver": "0"}
"""For ``ray start``: Ray (2.60) starts one idle worker per CPU when the first driver connects, for tasks; a run's
processes are actors, which get workers of their own, so those workers only cost their start (a run of two steps
on the 2-core CPU machine: 62 s of CPU time without them, 68 s with; docs/benchmarks.md)."""

LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", **NO_DRAIN_ENV,
                 **NORMAL_PRIORITY_ENV}
"""What a run on one machine needs (docs/architecture.md "Machine facts"): Ray's cluster mode off, so the driver
reaches the node on 127.0.0.1 (with it on, ``ray.init(address="127.0.0.1:<port>")`` rewrites the address to the
machine's external one, where the node does not listen, and waits forever); no token auth (a stale
~/.ray/auth_token would turn it on); no drain on stop (NO_DRAIN_ENV); workers at normal priority
(NORMAL_PRIORITY_ENV)."""


def set_local_ray_env() -> None:
    """Put LOCAL_RAY_ENV into os.environ (values the user set win) before ``ray`` is imported: Ray reads cluster
    mode once, at import. Raises when ray was imported first with cluster mode on (a driver that would hang)."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    if "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
            raise RuntimeError("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set, so this driver "
                               "would not reach a node on 127.0.0.1; export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")


class LocalRay:
    def __init__(self, num_cpus: int, log_path: Path):
        self.num_cpus, self.log_path = num_cpus, Path(log_path)
        self.address: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.temp_dir: Optional[str] = None

    def start(self) -> str:
        """Start the node and wait until it is up (its GCS answers and ``ray start`` says so); returns its address
        (host:port)."""
        port = free_port("127.0.0.1")
        remove_stale_temp_dirs()
        self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")  # short: Ray's socket paths stay < 107 chars
        Path(self.temp_dir, OWNER_FILE).write_text(str(os.getpid()))
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
                "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={self.num_cpus}",
                "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(tied_to_parent(args, group=True), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**NO_PRESTART_ENV, **{k: v for k, v in os.environ.items()
                                                                    if k != "RAY_ADDRESS"}})
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (answers("127.0.0.1", port) and STARTED_LINE in self.log_path.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"'ray start' did not open port {port} and report '{STARTED_LINE}' within "
                                   f"{START_TIMEOUT_S:g} s (exit code {self.proc.returncode}); its output: "
                                   f"{self.log_path}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{port}"
        return self.address

    @property
    def logs_dir(self) -> Optional[Path]:
        """Ray's log directory of this node (``worker-<id>-<job>-<pid>.out/.err`` per worker process)."""
        return Path(self.temp_dir, "session_latest", "logs") if self.temp_dir else None

    def stop(self, keep_logs_in: Optional[Path] = None) -> None:
        """End the node's process group (SIGTERM, then SIGKILL after TERM_GRACE_S), copy Ray's logs into
        ``keep_logs_in`` and remove the temp dir."""
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
                try:
                    os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the leader's pid
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.temp_dir:
            if keep_logs_in is not None and self.logs_dir.is_dir():
                shutil.copytree(self.logs_dir, keep_logs_in, dirs_exist_ok=True, ignore_dangling_symlinks=True,
                                ignore=shutil.ignore_patterns("*.sock", "nsight", "rocprof_sys", "profiles"))
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def connect(num_cpus: int, log_path: Path) -> Optional[LocalRay]:
    """Join the Ray cluster in RAY_ADDRESS (a SLURM job), or start this machine's node with ``num_cpus`` in a session
    of its own and connect to it; returns that node (to stop at the end), None when joined."""
    import ray

    if ray.is_initialized():
        return None
    # no "Connecting to existing Ray cluster" lines; the workers (and the engines they start) without transformers'
    # progress bars when the driver has them off (launch.py)
    bars = {k: os.environ[k] for k in ("HF_HUB_DISABLE_PROGRESS_BARS",) if k in os.environ}
    quiet = {"log_to_driver": True, "logging_level": logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": bars}, **quiet)
        return None
    set_local_ray_env()  # a no-op after launch.py's call; checks that ray was imported with it
    node = LocalRay(num_cpus, log_path)
    address = node.start()
    try:
        ray.init(address=address, **quiet,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **bars}})
    except BaseException:
        node.stop()
        raise
    return node


def remove_stale_temp_dirs() -> None:
    """Remove /tmp/ray_sh_* dirs whose driver is gone (it was killed before it could stop its node)."""
    for path in Path("/tmp").glob(f"{TEMP_PREFIX}*"):
        try:
            owner = int((path / OWNER_FILE).read_text())
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):  # another user's, or being created right now: leave it
            continue


def worker_log_tail(logs_dir: Optional[Path], pid: int, shown_in: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of the stdout and stderr Ray kept for worker process ``pid`` in ``logs_dir``, each
    under its name in ``shown_in`` (where ``stop`` copies them); "" when there is none (no dir, another node's
    worker, empty logs)."""
    if logs_dir is None or not logs_dir.is_dir():
        return ""
    parts = []
    for path in sorted(logs_dir.glob(f"worker-*-{pid}.*"), reverse=True):  # .out then .err
        text = path.read_text(errors="replace").splitlines()[-lines:]
        if text:
            parts.append(f"--- {shown_in / path.name} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(parts)


def dead_actor(error: BaseException) -> Optional[tuple[str, int, str]]:
    """(class name, pid, node ip) of the actor whose death ``error`` reports (Ray names them in its message), or
    None when the error is not an actor's death."""
    import ray.exceptions

    if not isinstance(error, ray.exceptions.RayActorError):
        return None
    text = str(error)
    found = [re.search(rf"{key}: (\S+)", text) for key in ("class_name", "pid", "ip")]
    if not all(found) or not found[1].group(1).isdigit():
        return None
    return found[0].group(1), int(found[1].group(1)), found[2].group(1)


def death_report(error: BaseException, local_ray: Optional[LocalRay], kept_logs: Path) -> str:
    """Which process died (Ray's class name and pid) and the last lines of its log (``kept_logs``: where
    ``LocalRay.stop`` copies Ray's logs), for the message a run stops with; the logs of workers on other nodes
    stay in Ray's session logs there."""
    dead = dead_actor(error)
    if dead is None:
        return f"a Ray actor died: {error}"
    name, pid, ip = dead
    tail = worker_log_tail(local_ray.logs_dir if local_ray is not None else None, pid, kept_logs)
    where = tail or f"(its log: worker-*-{pid}.out/.err in Ray's session logs on {ip})"
    return f"the run stops: {name} (pid {pid} on {ip}) died\n{where}"
