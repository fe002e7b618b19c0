"""Child processes that serve HTTP (engines, the router): start with a log file, wait until healthy, stop cleanly.

``ServerProcess`` runs any engine server from its argv: ``embedded_command(...)`` for the embedded engine, or
``SGLangLaunch.command(...)`` (``engines/sglang.py``) for real SGLang; both get the same health check
(``GET /health_generate``), log file (first line: the command) and stop.

Each child runs in its own session, so ``stop`` signals exactly the process group this object started (SIGTERM, then
SIGKILL after a grace period) and nothing else on the machine, and dies with the process that started it
(``lifetime.tied_to_parent``): a killed engine actor or rollout manager leaves no server behind.
"""

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from slime_hydra.lifetime import tied_to_parent
from slime_hydra.net import free_port


def http_status(url: str, timeout_s: float = 2.0) -> Optional[int]:
    """GET ``url`` and return the status code; None when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class ManagedProcess:
    """One child process with stdout+stderr in ``log_path``; ``stop`` ends it and its process group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Optional[Path] = None,
                 env: Optional[Mapping[str, str]] = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix=f"{name}_")) / f"{name}.log"
        self.env = dict(os.environ if env is None else env)
        self.popen: Optional[subprocess.Popen] = None

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(tied_to_parent(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        return self

    @property
    def pid(self) -> Optional[int]:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-n_chars:]

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
        """Poll ``ready()`` until true; RuntimeError with the log tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive:
                code = self.popen.returncode if self.popen else None
                raise RuntimeError(f"{self.name} exited (code {code}) before {what}; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not {what} after {timeout_s:.0f} s; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; return the exit code (None if never started).

        Signals go to the group only while its leader is alive (unreaped), so the group id cannot have been reused.
        """
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout=grace_s)
        return self.popen.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


HEALTH_PATH = "/health_generate"
"""The readiness and liveness check of every engine: SGLang and the embedded engine both answer it with 200 once a
one-token generation ran (or while generation is deliberately paused / memory released)."""


class ServerProcess(ManagedProcess):
    """An engine server (embedded or SGLang) listening on ``host:port``; the first log line is its command."""

    def __init__(self, name: str, argv: Sequence[str], host: str, port: int, log_path: Optional[Path] = None,
                 env: Optional[Mapping[str, str]] = None):
        super().__init__(name, argv, log_path, env)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(self.argv)}\n")
        super().start()
        return self

    def healthy(self, timeout_s: float = 70.0) -> bool:
        """One ``GET /health_generate`` (timeout_s: both servers give the probe up to 60 s) answered 200."""
        return http_status(f"{self.url}{HEALTH_PATH}", timeout_s) == 200

    def wait_healthy(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Poll /health_generate until 200; RuntimeError with the log tail if the process exits or time runs out."""
        self.wait_until(self.healthy, timeout_s, "healthy")
        return self


def embedded_command(model_path: str, host: str, port: int, device: str = "cpu", dtype: str = "auto",
                     max_batch_size: int = 64, extra_args: Sequence[str] = ()) -> list[str]:
    """argv of an embedded engine server (``python -m slime_hydra.rollout.engines.embedded``)."""
    return [sys.executable, "-m", "slime_hydra.rollout.engines.embedded", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--device", device, "--dtype", dtype,
            "--max-batch-size", str(max_batch_size), *extra_args]


class EngineProcess(ServerProcess):
    """An embedded engine server on ``host:port`` (a free port when none is given)."""

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: Optional[int] = None, device: str = "cpu",
                 dtype: str = "auto", max_batch_size: int = 64, extra_args: Sequence[str] = (),
                 log_path: Optional[Path] = None, env: Optional[Mapping[str, str]] = None):
        port = port or free_port(host)
        argv = embedded_command(model_path, host, port, device, dtype, max_batch_size, extra_args)
        super().__init__(f"engine_{port}", argv, host, port, log_path, env)


def start_embedded_engine(model_path: str, timeout_s: float = 180.0, **kwargs) -> EngineProcess:
    """Start an embedded engine (EngineProcess arguments) and return it once ``GET /health_generate`` answers 200."""
    engine = EngineProcess(model_path, **kwargs).start()
    try:
        return engine.wait_healthy(timeout_s)
    except BaseException:
        engine.stop()
        raise


TRACEBACK = "Traceback (most recent call last):\n"


def last_traceback(log_path: Path, n_chars: int = 1500) -> str:
    """The frames and error of the last Python traceback in a log, with what follows them (the last ``n_chars``);
    "" when there is none. Its first line is left out: Ray rewrites that line in an actor error's text."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    start = text.rfind(TRACEBACK)
    return "" if start < 0 else text[start + len(TRACEBACK):][-n_chars:]
