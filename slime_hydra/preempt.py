"""Preemption requests inside a SLURM job: the signal handlers and the flag the loop reads at a step boundary.

    install()      in the job's main thread: SIGUSR1, SIGUSR2 and SIGTERM set the flag (the previous handlers,
                   submitit's included, are kept so the job can hand over to submitit's requeue afterwards)
    requested()    True once one of them arrived: checkpoint after the step in progress and return "preempted"
    signal_name()  which one ("SIGUSR2", ...), or None

SLURM sends the ``--signal`` of the sbatch script (submitit's ``USR2@90``, or a site's ``--signal=USR1@300`` from
``cluster.sbatch_extra``) shortly before the time limit, SIGTERM on ``scancel`` and on preemption. The loop
finishes its step, writes a checkpoint and returns; the job function (launch/submit.py) then requeues through
submitit on USR1/USR2, and leaves SIGTERM to SLURM (a cancelled job stays cancelled; a preempted one is requeued
by SLURM itself when the partition's PreemptMode says so). Either way the next start runs with ``resume=auto``.
"""

import signal
import types
from typing import Callable, Optional, Union

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
"""The signals that ask the run to checkpoint and stop."""
EXIT_CODE = 75
"""What ``python launch.py`` exits with after a preemption: a checkpoint was written, re-running the same command
resumes (EX_TEMPFAIL of sysexits.h: "try again later"). 0 is a finished run, 2 a config error, 1 a failure."""

_Handler = Union[Callable[[int, Optional[types.FrameType]], object], int, None]
_received: Optional[int] = None
previous: dict[int, _Handler] = {}
"""The handlers install() replaced (submitit's SIGUSR2 requeue handler among them)."""


def _handle(signum: int, _frame: Optional[types.FrameType]) -> None:
    global _received
    _received = signum
    print(f"received {signal.Signals(signum).name}: checkpointing at the next step boundary", flush=True)


def install() -> None:
    """Route SIGUSR1/SIGUSR2/SIGTERM to the flag; call from the main thread (signal.signal requires it)."""
    for sig in SIGNALS:
        handler = signal.signal(sig, _handle)
        if handler is not _handle:
            previous[sig] = handler


def requested() -> bool:
    """True once a preemption / time-limit / cancel signal arrived."""
    return _received is not None


def signal_name() -> Optional[str]:
    """The signal that arrived ("SIGUSR1", "SIGUSR2", "SIGTERM"), or None."""
    return signal.Signals(_received).name if _received is not None else None


def reset() -> None:
    """Forget a request (tests, and a job that starts over in the same process)."""
    global _received
    _received = None
