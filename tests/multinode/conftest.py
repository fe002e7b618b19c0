"""A two-node SLURM cluster on this machine (.ci/multinode_up.sh: network namespaces, a fabric and a site network),
up for this directory's tests and taken down after them (the one-node SLURM of tests/slurm numbers its jobs
from 1 too, and Ray's temp dirs are named by job id).

It needs root (namespaces, slurmd); without it the tests skip, saying so, and with SLIME_HYDRA_REQUIRE_SLURM=1
(set by .ci/run) they fail instead, so CI never passes by skipping them. Every SLURM client and every launch runs on
a node (``TwoNodes.on``): only the nodes reach slurmctld, as on a cluster's login node.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from slime_hydra.config import PROJECT_ROOT
from tests.slurm.test_slurm import wait_until

STATE = Path(os.environ.get("SLIME_HYDRA_MULTINODE_STATE", "/tmp/slime_hydra_multinode"))
FABRIC = {"mnode1": "10.77.0.1", "mnode2": "10.77.0.2"}
"""The nodes' cluster addresses (.ci/multinode_net.sh)."""
SITE = {"mnode1": "10.78.0.1", "mnode2": "10.78.0.2", "mout": "10.78.0.9"}
"""The site network's addresses: the outsider ``mout`` reaches the nodes only here."""


@dataclass
class TwoNodes:
    state: Path

    def on(self, node: str, *cmd: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run cmd on node (mnode1, mnode2, mout) and return it finished (stdout/stderr as text)."""
        return subprocess.run([str(self.state / "bin" / "on_node"), node, *cmd], capture_output=True, text=True,
                              timeout=timeout, cwd=PROJECT_ROOT, env={**os.environ, **(env or {})})

    def launch(self, *overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """``python launch.py cluster=ci_two_node OVERRIDES`` on the login node (mnode1)."""
        return self.on("mnode1", sys.executable, str(PROJECT_ROOT / "launch.py"), "cluster=ci_two_node", *overrides,
                       timeout=timeout)

    def status(self, run_dir: Path) -> dict:
        """``python -m slime_hydra.status --json RUN_DIR``'s row for the run."""
        out = self.on("mnode1", sys.executable, "-m", "slime_hydra.status", "--json", str(run_dir), timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[0])

    def wait_for_end(self, run_dir: Path, timeout_s: float) -> dict:
        """The run's status once its job left SLURM's queue (COMPLETED, FAILED, CANCELLED, ...)."""
        def ended():
            row = self.status(run_dir)
            return row if row["state"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                                               "UNKNOWN", "SUBMITTED") else None
        return wait_until(ended, timeout_s, f"the job of {run_dir} to end", poll_s=2)


@pytest.fixture(scope="package")  # down once this directory is done: other SLURM tests reuse job ids
def two_nodes():
    reason = None
    if os.geteuid() != 0:
        reason = "the two-node cluster needs root (network namespaces, slurmd)"
    else:
        up = subprocess.run([str(PROJECT_ROOT / ".ci" / "multinode_up.sh"), str(STATE)], capture_output=True,
                            text=True, timeout=600)
        if up.returncode != 0:
            reason = f".ci/multinode_up.sh failed: {up.stderr.strip()[-2000:]}"
    if reason:
        if os.environ.get("SLIME_HYDRA_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    try:
        yield TwoNodes(STATE)
    finally:
        subprocess.run([str(PROJECT_ROOT / ".ci" / "multinode_down.sh"), str(STATE)], capture_output=True, timeout=120)
