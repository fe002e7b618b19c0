"""Add, remove or list the engines of a running run: ``python -m slime_hydra.engines add|remove|list RUN_DIR``.

    python -m slime_hydra.engines add runs/r                # one more engine, with the newest weights, in the router
    python -m slime_hydra.engines remove runs/r 0           # drain engine 0 (its requests finish there) and stop it
    python -m slime_hydra.engines list runs/r               # every engine: index, address, in service or why not

The request goes through the run directory (rollout/engine_requests.py) and the driver answers it at the next step
boundary; this command waits for the answer and prints it. Exit status 0 when done, 1 when the run refused it (the
reason printed: e.g. the last engine in service), 2 when the run is not running. A local run is known to run by
its run.json (status.py); for a run on another host (a SLURM job) the command waits up to ``--timeout``.
"""

import argparse
import sys
from pathlib import Path
from typing import Optional

from slime_hydra.checkpoint import RUN_RECORD
from slime_hydra.rollout import engine_requests
from slime_hydra.status import local_state


def _gone(run_dir: Path) -> Optional[str]:
    state, why = local_state(run_dir)
    if state in ("RUNNING", "UNKNOWN"):  # UNKNOWN: a driver on another host, which may well answer
        return None
    return f"the run in {run_dir} is not running ({state}{': ' + why if why else ''}): no driver to ask"


def _row(engine: dict) -> str:
    where = "in service" if engine["up"] else f"out of service: {engine['cause']}"
    router = "in the router" if engine["in_router"] else "not in the router"
    retried = f"; {engine['retried']} requests it held were retried elsewhere" if engine.get("retried") else ""
    return f"engine {engine['index']} ({engine['url']}): {where}, {router}{retried}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=engine_requests.OPS)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("index", type=int, nargs="?", help="remove: the engine's index (as list shows it)")
    parser.add_argument("--drain-timeout", type=float, default=engine_requests.DRAIN_TIMEOUT_S,
                        help="remove: seconds the engine may take to finish its requests before they are retried "
                             "on the others")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the driver's answer (it answers between steps; an added engine "
                             "starts first)")
    args = parser.parse_args(argv)
    if args.op == "remove" and args.index is None:
        parser.error("remove needs the index of the engine to remove (python -m slime_hydra.engines list RUN_DIR)")
    if not (args.run_dir / RUN_RECORD).is_file():
        print(f"{args.run_dir} is not a run directory (no {RUN_RECORD})", file=sys.stderr)
        return 2
    why = _gone(args.run_dir)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    reply = engine_requests.submit(args.run_dir, args.op, args.index, args.drain_timeout)
    try:
        answer = engine_requests.wait_reply(reply, args.timeout, lambda: _gone(args.run_dir))
    except (RuntimeError, TimeoutError) as error:
        print(error, file=sys.stderr)
        return 2
    if not answer["ok"]:
        print(f"refused: {answer['error']}", file=sys.stderr)
        return 1
    verb = {"add": "added: ", "remove": "removed: ", "list": ""}[args.op]
    for engine in answer["engines"]:
        print(verb + _row(engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
