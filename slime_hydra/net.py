"""Small network helpers every process uses: a free port, whether a port answers, and the wait before a retry.

Written here rather than taken from a library: ``free_port`` is the socket idiom itself, and the retry loops that
use ``backoff_s`` do work between attempts (health checks, restoring a sample) that a retry decorator such as
tenacity would hide in callbacks; what they share is only the delay formula.
"""

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def backoff_s(attempt: int, first_s: float, cap_s: float = 30.0, jitter: float = 0.25) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): capped exponential backoff with jitter,

        min(cap_s, first_s * 2**attempt) * (1 + u),   u ~ Uniform(-jitter, +jitter)

    so clients that failed together do not retry in lockstep."""
    return min(cap_s, first_s * 2 ** attempt) * (1.0 + random.uniform(-jitter, jitter))
