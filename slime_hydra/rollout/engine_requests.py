"""Requests to add, remove or list the engines of a running run, carried through its run directory.

    python -m slime_hydra.engines add RUN_DIR       (engines.py)   submit(run_dir, "add") -> reply path; wait_reply
    after every step, in the driver (loop.py)                      serve(run_dir, manager)

A request is ``<run_dir>/engine_requests/<id>.request.json`` (``{"op": "add" | "remove" | "list", "index": i,
"drain_timeout_s": s}``). At the next step boundary the driver answers each, oldest first, through the rollout
manager (``add_engine``, ``remove_engine``, ``engine_status``; rollout/engine_pool.py drains a removed engine and
gives an added one the newest weights) with ``<id>.reply.json``: ``{"ok": true, "engines": [rows]}`` (the
engine added or removed, or every engine for ``list``; rows as ``EnginePool.status`` gives them), or ``{"ok":
false, "error": why}`` for a request the manager refused (an unknown index, the last engine in service, a
colocated run); then it removes the request. A refused request does not end the run.

Why a folder and not a port: it opens no control plane (whoever may write the run directory may ask, no one
else), and it reaches a driver on any node of a cluster whose nodes share the filesystem, as SLURM runs do.
Written by hand: no library carries requests into a training loop.
"""

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import ray

from slime_hydra.durable import write_json
from slime_hydra.rollout.engine_pool import DRAIN_TIMEOUT_S

OPS = ("add", "remove", "list")
"""What a request may ask."""
REQUESTS = "engine_requests"
"""The folder of a run directory that holds the requests and replies."""
POLL_S = 0.2
"""How often a waiting requester looks for its reply (s)."""


def submit(run_dir: Path, op: str, index: Optional[int] = None,
           drain_timeout_s: float = DRAIN_TIMEOUT_S) -> Path:
    """Write a request; returns the path its reply will have."""
    if op not in OPS:
        raise ValueError(f"unknown engine request {op!r}: one of {', '.join(OPS)}")
    if op == "remove" and index is None:
        raise ValueError("remove needs the index of the engine to remove")
    folder = Path(run_dir) / REQUESTS
    folder.mkdir(exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}"
    write_json(folder / f"{name}.request.json", {"op": op, "index": index, "drain_timeout_s": drain_timeout_s})
    return folder / f"{name}.reply.json"


def wait_reply(reply: Path, timeout_s: float, gone: Callable[[], Optional[str]]) -> dict:
    """The reply, once the driver wrote it. ``gone()`` says why no reply can come (the run ended), else None;
    raises RuntimeError then, TimeoutError after ``timeout_s`` (the request stays; the driver answers it later)."""
    deadline = time.monotonic() + timeout_s
    while not reply.exists():
        why = gone()
        if why is not None:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reply within {timeout_s:g} s in {reply} (the driver answers between steps)")
        time.sleep(POLL_S)
    return json.loads(reply.read_text())


def serve(run_dir: Path, manager) -> int:
    """Answer every waiting request, oldest first (see the module docstring); returns how many."""
    folder = Path(run_dir) / REQUESTS
    if not folder.is_dir():
        return 0
    requests = sorted(folder.glob("*.request.json"))
    for request in requests:
        try:
            ask = json.loads(request.read_text())
            if ask["op"] == "add":
                engines = [ray.get(manager.add_engine.remote())]
            elif ask["op"] == "remove":
                engines = [ray.get(manager.remove_engine.remote(int(ask["index"]), float(ask["drain_timeout_s"])))]
            elif ask["op"] == "list":
                engines = ray.get(manager.engine_status.remote())
            else:
                raise ValueError(f"unknown engine request {ask['op']!r}: one of {', '.join(OPS)}")
            answer = {"ok": True, "engines": engines}
        except ray.exceptions.RayTaskError as error:  # the manager refused it: its own message, not the traceback
            answer = {"ok": False, "error": str(error.cause if error.cause is not None else error)}
        except (OSError, ValueError, KeyError, TypeError) as error:  # a request that is not one
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        write_json(request.with_name(request.name.replace(".request.json", ".reply.json")), answer)
        request.unlink()
        print(f"loop: engine request {request.name}: "
              f"{'done' if answer['ok'] else 'refused: ' + answer['error']}", flush=True)
    return len(requests)
