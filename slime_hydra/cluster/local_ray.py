"""The Ray node of a run on one machine (no RAY_ADDRESS), in a session of its own.

``ray.init()`` would start Ray's GCS and raylet as children of the driver, in its process group: a signal to the
whole group (``timeout``, a service manager, Ctrl-C in some shells, ``kill -- -PGID``) then reaches them at the same
moment as the driver and kills them before the driver can write its checkpoint. Started here instead:
``ray start --head --block`` in a new session (so the group signal reaches only the driver, whose handler
checkpoints at the next step boundary and shuts everything down in order), tied to the driver
(``lifetime.tied_to_parent``: if the driver is killed, ``ray start`` is too and Ray's reaper ends the node), then
the driver connects with ``ray.init(address=...)``. Its temp dir is private (``/tmp/ray_sh_*``, removed by
``stop``), so a plain ``ray.init()`` elsewhere on the machine does not attach to this run's node. ``stop`` disconnects and ends the node's process group (SIGTERM,
SIGKILL after a grace period), with a bounded wait at every step.
"""

import os
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
STOP_GRACE_S = 10.0
"""Seconds the node's process group gets between SIGTERM and SIGKILL."""


class LocalRay:
    def __init__(self, num_cpus: int, log_path: Path):
        self.num_cpus, self.log_path = num_cpus, Path(log_path)
        self.address: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.temp_dir: Optional[str] = None

    def start(self) -> str:
        """Start the node and wait until its GCS answers; returns its address (host:port)."""
        port = free_port("127.0.0.1")
        self.temp_dir = tempfile.mkdtemp(prefix="ray_sh_", dir="/tmp")  # short: Ray's socket paths stay < 107 chars
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
                "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={self.num_cpus}",
                "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(tied_to_parent(args), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers("127.0.0.1", port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"'ray start' did not open port {port} within {START_TIMEOUT_S:g} s "
                                   f"(exit code {self.proc.returncode}); its output: {self.log_path}")
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port}"
        return self.address

    def stop(self) -> None:
        """End the node's process group (SIGTERM, then SIGKILL after STOP_GRACE_S) and remove its temp dir."""
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the leader's pid
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=STOP_GRACE_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
