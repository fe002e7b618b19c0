"""A real SLURM for these tests: .ci/slurm_up.sh stands one up on loopback (.ci/run does it before the suite).

Without one answering ``sinfo`` the tests skip, saying so; with SLIME_HYDRA_REQUIRE_SLURM=1 (set by .ci/run)
they fail instead, so CI can never pass by skipping them.
"""

import os
import subprocess
from pathlib import Path

import pytest

from slime_hydra.config import PROJECT_ROOT

STATE = Path(os.environ.get("SLIME_HYDRA_SLURM_STATE", "/tmp/slime_hydra_slurm"))

if "SLURM_CONF" not in os.environ and (STATE / "slurm.conf").exists():  # started by hand with .ci/slurm_up.sh
    os.environ["SLURM_CONF"] = str(STATE / "slurm.conf")
if (STATE / "bin" / "sacct").exists() and str(STATE / "bin") not in os.environ["PATH"].split(os.pathsep):
    os.environ["PATH"] = f"{STATE / 'bin'}{os.pathsep}{os.environ['PATH']}"  # the sacct stand-in first


def _slurm_state() -> str:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"sinfo unavailable ({error})"
    return out.stdout.strip() if out.returncode == 0 else f"sinfo failed: {out.stderr.strip()}"


@pytest.fixture(scope="session")
def slurm():
    """Skip (or fail under SLIME_HYDRA_REQUIRE_SLURM=1) unless a SLURM node answers; jobs import tests/ too."""
    state = _slurm_state()
    if not state.split("\n")[0] in ("idle", "mixed", "allocated", "completing"):
        reason = f"no SLURM answering here ({state}); start one with .ci/slurm_up.sh"
        if os.environ.get("SLIME_HYDRA_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    return state
