"""The run's API key: one secret per run that every engine and the router require, so that a server listening on a
routable address (multi-node runs), or on a shared machine's loopback, obeys only this run.

What it protects. Every endpoint except ``/health`` and ``/health_generate`` (``OPEN_PREFIX``) answers 401 without
``Authorization: Bearer <key>``: the control endpoints (weight updates, the broadcast group, memory release/resume,
abort, pause/continue, flush_cache), and ``/generate`` and the info endpoints too. This is what SGLang's own
``--api-key`` does (0.5.23: every endpoint but ``/health*`` and ``/metrics*``), so both engines behave the same, and it
is what sglang-router 0.3.2 needs: its first health probe of a new worker carries no key (so ``/health`` must stay
open), and after that it sends the key registered with the worker (``POST /workers {"url", "api_key"}``) on every
health check, ``/server_info``, ``/model_info`` and ``/generate``. The router's own ``--api-key`` (the same key)
guards its ``/generate`` and ``/workers`` admin calls; its ``/health`` and ``/readiness`` stay open.

Who makes it, how it travels. The rollout manager makes one key when it starts (``new_api_key``) and writes it to
``<run_dir>/api_key`` (mode 0600: an operator's curl, and tests, read it there). It never goes on a command line,
which every local user can read in ``/proc/<pid>/cmdline`` (``ps``):

- the embedded engine and the router read it from the environment variable ``API_KEY_ENV`` (``/proc/<pid>/environ``
  is readable by the owner only); the router runs as ``python -m slime_hydra.rollout.router``, sglang-router's own
  launcher with the key put into its arguments in-process;
- SGLang takes it from a YAML file named by ``--config`` (``engines/sglang.py``), written with mode 0600 in a private
  directory on the engine's node;
- to the engine actors it goes as an argument of a Ray call: whoever can reach Ray can run code in the run anyway.

An embedded engine started without a key (a test, a standalone server) serves openly, and refuses a host other than
loopback.
"""

import hmac
import os
import secrets
from pathlib import Path
from typing import Optional

API_KEY_ENV = "SLIME_HYDRA_API_KEY"
"""The environment variable the embedded engine and the router read the key from."""
API_KEY_FILE = "api_key"
"""The file in the run directory holding the run's key (mode 0600)."""
OPEN_PREFIX = "/health"
"""Paths served without the key: liveness and readiness checks (``/health``, ``/health_generate``)."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Hosts on which an embedded engine may serve without a key."""


def new_api_key() -> str:
    """256 random bits as hex (hex never starts with '-', which argparse would read as a flag)."""
    return secrets.token_hex(32)


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by the owner only (mode 0600 from creation, never wider)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode under O_CREAT
        f.write(text)
    return path


def read_api_key(run_dir: Path) -> str:
    """The key of the run in ``run_dir`` (written by the rollout manager when it started)."""
    return (Path(run_dir) / API_KEY_FILE).read_text().strip()


def bearer(api_key: Optional[str]) -> dict[str, str]:
    """The request header that carries ``api_key`` (none for None)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def authorized(header: Optional[str], api_key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` (compared in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
