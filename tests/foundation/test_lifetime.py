"""lifetime.tied_to_parent: a server started through it dies when the process that started it is killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import sys, time
from slime_hydra.rollout.engines.process import ManagedProcess
child = ManagedProcess("sleeper", ["sleep", "1000"], log_path=sys.argv[1]).start()
print(child.pid, flush=True)
time.sleep(1000)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _gone_after_killing(parent: subprocess.Popen, pid: int) -> bool:
    """SIGKILL ``parent``; whether ``pid`` is gone (or a zombie) within 10 s."""
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_managed_process_dies_with_the_process_that_started_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "sleeper.log")], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":  # the launcher exec's it
            assert time.monotonic() < deadline, "the launcher did not exec the command in its own process"
            time.sleep(0.05)
        assert _gone_after_killing(parent, child), "the server outlived the process that started it"
    finally:
        parent.kill()


def test_the_launcher_refuses_to_start_when_its_parent_is_already_gone():
    out = subprocess.run([sys.executable, "-m", "slime_hydra.lifetime", "1", "true"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 1 and "parent 1 is gone" in out.stderr


GROUP_PARENT = """
import subprocess, sys, time
from slime_hydra.lifetime import tied_to_parent
subprocess.Popen(tied_to_parent(["sh", "-c", "sleep 1000 & echo $!; wait"], group=True), start_new_session=True)
time.sleep(1000)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_with_group_the_commands_children_die_with_the_process_that_started_it():
    """As Ray's agents, children of the raylet, of ``ray start``: a grandchild in the group goes too."""
    parent = subprocess.Popen([sys.executable, "-c", GROUP_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert _gone_after_killing(parent, grandchild), "the command's child outlived the process that started it"
    finally:
        parent.kill()
