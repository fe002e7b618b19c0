"""Child processes that die with their parent, so nothing of a run outlives it.

Engine and router servers run in sessions of their own (so a stop signals exactly their process group), which
also means nothing kills them when the Ray actor that started them dies, even by SIGKILL. ``tied_to_parent(argv)``
returns a command that first asks Linux to SIGKILL the process when its parent thread exits
(``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), exits at once if that parent is already gone, then ``exec``s
``argv``. It runs as a small launcher (``python -m slime_hydra.lifetime PARENT_PID ARGV...``) rather than a
``preexec_fn``, which may deadlock in a multi-threaded parent such as a Ray worker. The signal follows the thread
that started the child: start servers from a thread that lives as long as the parent (an actor's main thread or
its event loop). Written here because neither the standard library nor Ray offers it; elsewhere than Linux the
command is ``argv`` unchanged.

``tied_to_parent(argv, group=True)``, for a command that leads a process group of its own (``start_new_session``):
when it dies, its whole group is SIGKILLed too, by a reaper the launcher forks into the group before the ``exec``.
``ray start`` needs it: Ray ties its daemons to it, but its two agents are the raylet's children and, once the
raylet is gone, wait for the dead GCS for 60 s before they exit.
"""

import os
import signal
import sys
from typing import Sequence

PR_SET_PDEATHSIG = 1


GROUP_FLAG = "--group"


def _set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    import ctypes

    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def tied_to_parent(argv: Sequence[str], group: bool = False) -> list[str]:
    """``argv`` run so that it is killed when this process (the thread that starts it) dies; with ``group``, its
    process group goes with it (start it with ``start_new_session``)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", "slime_hydra.lifetime", *([GROUP_FLAG] if group else []), str(os.getpid()), *argv]


def _reap_group(leader: int) -> None:
    """In the child forked by ``main``: once ``leader`` (the launcher, then the command it ``exec``s) dies, SIGKILL
    the process group, this process included. A SIGTERM to the group (a stop) leaves it waiting for the leader."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    _set_parent_death_signal(signal.SIGHUP)
    if os.getppid() == leader:  # else the leader died before the signal was armed
        signal.sigwait({signal.SIGHUP})
    os.killpg(0, signal.SIGKILL)


def die_with_parent() -> None:
    """``preexec_fn`` form, for a parent with a single thread (the SLURM job process starting ``ray start``)."""
    if sys.platform.startswith("linux"):
        try:
            _set_parent_death_signal()
        except OSError:
            pass


def main(args: list[str]) -> None:
    group = args[0] == GROUP_FLAG
    parent, argv = int(args[group]), args[group + 1:]
    _set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(f"slime_hydra.lifetime: parent {parent} is gone; not starting {argv[0]}")
    if group and os.fork() == 0:
        _reap_group(os.getppid())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
