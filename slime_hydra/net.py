"""Small network helpers every process uses: a free port, whether a port answers, the wait before a retry, and the
rendezvous store of a process group listening on one address.

Written here rather than taken from a library: ``free_port`` is the socket idiom itself, and the retry loops that
use ``backoff_s`` do work between attempts (health checks, restoring a sample) that a retry decorator such as
tenacity would hide in callbacks; what they share is only the delay formula.

``tcp_store`` exists because torch's own rendezvous (``env://``, ``tcp://``) starts rank 0's TCPStore on every
interface (``*:port``) and the store has no authentication: on a cluster anyone who reaches the port could join the
group. TCPStore has no bind-address option, only ``master_listen_fd`` (a socket the caller already bound), so
``listen_socket`` binds one by hand to the master address alone.
"""

import os
import random
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore


PORT_ATTEMPTS = 3
"""Starts of a server (the router, an engine) on ports ``free_port`` picked: a port free when picked can be taken (by
another process's outgoing connection, say) before the server binds it, and the server then exits with "address
already in use"; it starts again on a new pick, this many times in all."""


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


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host``:``port`` (IPv4; a name resolves to its first IPv4 address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # binds while a closed store's links linger
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> "TCPStore":
    """The rendezvous store of a ``world_size``-rank process group: rank 0 hosts it on ``host``:``port`` only, the
    others connect to it. Rank 0 returns once every rank joined (or raises when ``timeout`` passes first)."""
    import torch.distributed as dist  # here, not at the top: most users of this module need no torch

    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    with listen_socket(host, port) as sock:
        # The store takes the descriptor it is given and closes it when it is destroyed or fails waiting for the
        # ranks (measured: tests/foundation/test_store_binding.py), so it gets a duplicate and ``sock`` closes its
        # own. The descriptor need not be inheritable: the store lives in this process.
        fd = os.dup(sock.fileno())
        try:
            return dist.TCPStore(host, port, world_size, is_master=True, master_listen_fd=fd, use_libuv=True,
                                 timeout=timeout)
        except BaseException:
            if _same_open_file(fd, sock.fileno()):  # failed before the store took the descriptor
                os.close(fd)
            raise


def _same_open_file(fd: int, other: int) -> bool:
    try:
        return os.path.sameopenfile(fd, other)
    except OSError:
        return False
