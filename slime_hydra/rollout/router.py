"""The real sglang-router as a child process: start it empty, add and remove engines at runtime, stop it.

The router starts with no workers (``--worker-urls`` is never passed): engines come and go through its runtime API,
``POST /workers {"url"}`` (202, a ``worker_id``) and ``DELETE /workers/{worker_id}``. Its ``/health`` answers 200
before any worker is registered, so readiness is ``GET /readiness`` (``healthy_workers``). Everything binds
127.0.0.1 unless told otherwise, the Prometheus exporter included (its default is 0.0.0.0).

Known router behaviour (sglang-router 0.3.2): it probes a new worker over gRPC before HTTP (the embedded engine
drops the resulting parser errors from its log), asks it for ``/server_info`` and ``/model_info``, tries to fetch a
tokenizer for ``model_path`` from the hub (offline: one warning), re-serialises ``/generate`` bodies keeping only the
fields it knows (a batch cannot carry a list of rids), and passes responses through unchanged.

The API key (rollout/auth.py). Given the run's key, the router requires it on its ``/generate`` and ``/workers``
calls (sglang-router's ``--api-key``; ``/health`` and ``/readiness`` stay open), every engine is registered with it
(``POST /workers {"url", "api_key"}``), and the router sends it to that engine on its health checks, info requests and
every ``/generate`` it forwards. sglang-router takes ``--api-key`` only on its command line, which every local user
can read, so the process runs ``python -m slime_hydra.rollout.router`` (``main`` below): sglang-router's own argument
parser and launcher, with the key taken from the environment (``API_KEY_ENV``) and set in-process.

The admin calls here are synchronous (urllib): they are rare, and callers in async code can wrap them in
``asyncio.to_thread``.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from slime_hydra.net import PORT_ATTEMPTS, free_port
from slime_hydra.rollout.auth import API_KEY_ENV, bearer
from slime_hydra.rollout.config import ROUTER_POLICIES
from slime_hydra.rollout.engines.process import ManagedProcess, http_status


class RouterError(RuntimeError):
    """The router refused an admin call or did not reach the expected state in time."""


class Router:
    """One sglang-router process.

    port / prometheus_port: None picks free ports (both None: ``start`` picks new ones when the router finds one
    taken, up to PORT_ATTEMPTS times). policy: a sglang-router load-balancing policy.
    health_check_interval_s: seconds between the router's health checks of each worker (3 failures in a row mark a
    worker unhealthy). log_level: the router's own (debug | info | warn | error). extra_args: more router flags.
    api_key: the run's key, required by the router and sent to every engine it registers (None: none).
    """

    def __init__(self, host: str = "127.0.0.1", port: Optional[int] = None, prometheus_port: Optional[int] = None,
                 policy: str = "round_robin", health_check_interval_s: int = 5, log_level: str = "warn",
                 log_path: Optional[Path] = None, extra_args: Sequence[str] = (),
                 env: Optional[Mapping[str, str]] = None, api_key: Optional[str] = None):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy={policy!r}; choose one of {ROUTER_POLICIES}")
        self.api_key = api_key
        self.host = host
        self._picked = port is None and prometheus_port is None
        self.port = port or free_port(host)
        self.prometheus_port = prometheus_port or free_port(host)
        self.policy = policy
        self._flags = ["--policy", policy, "--health-check-interval-secs", str(health_check_interval_s),
                       "--log-level", log_level, *extra_args]
        self._log_path = log_path
        self._env = dict(os.environ if env is None else env)
        self._env.pop(API_KEY_ENV, None)
        if api_key:
            self._env[API_KEY_ENV] = api_key
        self.process = self._process()

    def _process(self) -> ManagedProcess:
        argv = [sys.executable, "-m", "slime_hydra.rollout.router", "--host", self.host, "--port", str(self.port),
                "--prometheus-host", self.host, "--prometheus-port", str(self.prometheus_port), *self._flags]
        return ManagedProcess(f"router_{self.port}", argv, self._log_path, self._env)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "Router":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> "Router":
        """Start the process and return once its HTTP server answers (it has no workers yet); on ports picked here,
        again on new ones when one was taken (PORT_ATTEMPTS)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.process.start()
            try:
                self.process.wait_until(lambda: http_status(f"{self.url}/health") == 200, timeout_s, "serving")
                break
            except BaseException as error:
                self.process.stop()
                if not (self._picked and attempt < PORT_ATTEMPTS and "Address already in use" in str(error)):
                    raise
            self.port, self.prometheus_port = free_port(self.host), free_port(self.host)
            self.process = self._process()
        return self

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``grace_s``; return the exit code."""
        return self.process.stop(grace_s)

    # -- admin API --------------------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, payload: Optional[dict] = None, timeout_s: float = 10.0):
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {**bearer(self.api_key), **({"Content-Type": "application/json"} if data else {})}
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            raise RouterError(f"{method} {self.url}{path}: router not reachable ({exc}); log {self.process.log_path}:"
                              f"\n{self.process.log_tail(2000)}") from exc

    def workers(self) -> list[dict]:
        """The router's worker list (each with id, url, is_healthy, load, ...)."""
        status, body = self._call("GET", "/workers")
        if status != 200:
            raise RouterError(f"GET /workers -> {status}: {body}")
        return body.get("workers", [])

    def add_worker(self, url: str) -> str:
        """Register an engine URL; return its worker_id (registration finishes in the background: wait_ready). The
        router sends the engine the run's key from then on."""
        worker = {"url": url, "api_key": self.api_key} if self.api_key else {"url": url}
        status, body = self._call("POST", "/workers", worker)
        if status not in (200, 201, 202) or not isinstance(body, dict) or "worker_id" not in body:
            raise RouterError(f"POST /workers {url} -> {status}: {body}")
        return body["worker_id"]

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister the worker at ``url`` and wait until the router no longer lists it."""
        matches = [w["id"] for w in self.workers() if w.get("url") == url]
        if not matches:
            raise RouterError(f"no worker with url {url}; workers: {[w.get('url') for w in self.workers()]}")
        for worker_id in matches:
            status, body = self._call("DELETE", f"/workers/{urllib.parse.quote(worker_id, safe='')}")
            if status not in (200, 202, 204):
                raise RouterError(f"DELETE /workers/{worker_id} -> {status}: {body}")
        self._wait(lambda: all(w.get("url") != url for w in self.workers()), timeout_s, f"{url} removed")

    def readiness(self) -> dict:
        """GET /readiness: {"status", "healthy_workers", "total_workers"} (or a reason when not ready)."""
        _, body = self._call("GET", "/readiness")
        return body if isinstance(body, dict) else {"status": str(body)}

    def wait_ready(self, min_healthy: int = 1, timeout_s: float = 60.0) -> list[dict]:
        """Wait until at least ``min_healthy`` workers are healthy; return the last worker list. Polls
        ``GET /workers`` (200 always), not ``/readiness``: the router logs each 503 "not ready" answer as an ERROR,
        which made every healthy run's router.log look broken."""
        last: list[dict] = []

        def ready() -> bool:
            nonlocal last
            last = self.workers()
            return sum(bool(w.get("is_healthy")) for w in last) >= min_healthy

        self._wait(ready, timeout_s, lambda: f"{min_healthy} healthy workers (last worker list: {last})")
        return last

    def wait_worker_healthy(self, url: str, timeout_s: float = 60.0) -> None:
        """Wait until the router lists the worker at ``url`` as healthy (after add_worker)."""
        self._wait(lambda: any(w.get("url") == url and w.get("is_healthy") for w in self.workers()), timeout_s,
                   f"{url} healthy in the worker list")

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: Union[str, Callable[[], str]],
              poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            describe = what() if callable(what) else what
            if not self.process.alive:
                raise RouterError(f"router exited before {describe}; log {self.process.log_path}:\n"
                                  f"{self.process.log_tail()}")
            if time.monotonic() > deadline:
                raise RouterError(f"router: no {describe} within {timeout_s:.0f} s; log {self.process.log_path}:\n"
                                  f"{self.process.log_tail()}")
            time.sleep(poll_s)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode(errors="replace")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m slime_hydra.rollout.router [sglang-router flags]``: run sglang-router (its own parser and launcher)
    with ``--api-key`` taken from ``API_KEY_ENV`` instead of the command line; serves until stopped."""
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(list(sys.argv[1:] if argv is None else argv))
    args.api_key = os.environ.pop(API_KEY_ENV, None) or None
    launch_router(args)


if __name__ == "__main__":
    main()
