"""The rendezvous stores of the trainer's process group and of the weight-update group listen on the master address
alone (net.tcp_store), never on every interface: the socket table shows the one LISTEN socket on 127.0.0.1, none
on 0.0.0.0 or ::, and a connection to another address of this machine is refused. The store owns the descriptor it
is given (it closes it with itself, or when the ranks never come), which is why tcp_store hands it a duplicate.

Rank 0 runs in the test process, so the socket table is read while its store is up; rank 1 is a subprocess that
connects whenever it is ready (a client retries until its timeout), so nothing races a sleep.
"""

import gc
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from slime_hydra.net import free_port, listen_socket, tcp_store

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(seconds=60)
"""Generous: rank 1 imports torch on a busy 2-core machine before it connects."""


def listeners(port: int) -> list[str]:
    """Local IPs of every LISTEN TCP socket (IPv4 and IPv6, any process) on ``port``."""
    return sorted(c.laddr.ip for c in psutil.net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def own_listeners() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def own_sockets(port: int) -> list[tuple]:
    """This process's TCP sockets on ``port`` (listening on it, or connected to or from it), any state. Only the
    test's own: the worker's other threads (gRPC, aiohttp of earlier tests) open and close sockets of their own at
    any moment, so a count of every socket of the process is not the test's to assert."""
    return [(c.laddr, c.raddr, c.status) for c in psutil.Process().net_connections(kind="tcp")
            if c.laddr.port == port or (c.raddr and c.raddr.port == port)]


def same_open_file(fd: int, other: int) -> bool:
    try:
        return os.path.sameopenfile(fd, other)
    except OSError:  # fd is closed
        return False


def other_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)


def start_rank1(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def finish(child: subprocess.Popen) -> dict:
    """Rank 1's last output line (JSON), once it exited 0."""
    try:
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_listen_socket_binds_the_given_address_only():
    port = free_port()
    with listen_socket("127.0.0.1", port) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
        assert listeners(port) == ["127.0.0.1"]
    assert listeners(port) == []


def test_master_store_listens_on_the_master_address_only():
    port = free_port()
    store = tcp_store("127.0.0.1", port, 0, 1, TIMEOUT)
    assert listeners(port) == ["127.0.0.1"]  # no "0.0.0.0", no "::"
    client = tcp_store("127.0.0.1", port, 1, 1, TIMEOUT)
    client.set("key", "value")
    assert store.get("key") == b"value"
    del client, store
    gc.collect()
    assert listeners(port) == []
    assert own_sockets(port) == []  # none leaked (the store closes the one it owns: the test below)


def test_other_addresses_of_this_machine_are_refused():
    ip = other_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = free_port()
    store = tcp_store("127.0.0.1", port, 0, 1, TIMEOUT)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, port), timeout=10).close()
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        del store


def test_the_store_owns_the_descriptor_it_is_given():
    """What tcp_store's duplicate is for: the store closes master_listen_fd when it goes, so the caller's socket
    must not close the same descriptor again."""
    port = free_port()
    with listen_socket("127.0.0.1", port) as sock:
        fd = os.dup(sock.fileno())
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, master_listen_fd=fd, use_libuv=True,
                              timeout=TIMEOUT)
        assert same_open_file(fd, sock.fileno())
        del store
        gc.collect()
        assert not same_open_file(fd, sock.fileno())  # closed (were its number reused, by another file)


def test_a_master_whose_ranks_never_come_leaves_no_socket():
    port = free_port()
    with pytest.raises(dist.DistStoreError):  # "waiting for clients. 1/2 clients joined"
        tcp_store("127.0.0.1", port, 0, 2, timedelta(seconds=1))
    gc.collect()
    assert listeners(port) == []
    assert own_sockets(port) == []


def _weight_update_rank1(port: int) -> None:
    """Rank 1 of the weight-update group: receive two tensors, print them as JSON."""
    from slime_hydra.weight_transport import destroy_weight_update_group, init_weight_update_group, recv_named_tensors

    group = init_weight_update_group("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT.total_seconds())
    got = recv_named_tensors(group, ["w", "b"], ["float32", "int64"], [[2, 3], [4]])
    destroy_weight_update_group(group)
    print(json.dumps({name: t.tolist() for name, t in got.items()}), flush=True)


def test_weight_update_group_broadcasts_and_listens_on_loopback_only():
    from slime_hydra.weight_transport import destroy_weight_update_group, init_weight_update_group, send_named_tensors

    port = free_port()
    listening_before = own_listeners()
    child = start_rank1(f"from tests.foundation.test_store_binding import _weight_update_rank1; "
                        f"_weight_update_rank1({port})")
    try:
        group = init_weight_update_group("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT.total_seconds())
    except BaseException:
        child.kill()
        raise
    try:
        assert listeners(port) == ["127.0.0.1"]
        opened = own_listeners() - listening_before  # the store's and gloo's own listeners
        assert ("127.0.0.1", port) in opened and {ip for ip, _ in opened} == {"127.0.0.1"}
        weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
        bias = torch.tensor([7, -1, 0, 2**40])
        send_named_tensors(group, [("w", weight), ("b", bias)])
        got = finish(child)
    finally:
        destroy_weight_update_group(group)
    assert got == {"w": [[0.0, 0.25, 0.5], [0.75, 1.0, 1.25]], "b": [7, -1, 0, 2**40]}
    del group  # the group holds its store: the store (and its socket) goes with the last reference
    gc.collect()
    assert listeners(port) == []


def _trainer_rank1(port: int) -> None:
    """Rank 1 of the trainer's group: all-reduce (rank + 1) * [1, 2, 3], print the sum as JSON."""
    from slime_hydra.train.backend import init_distributed

    init_distributed(1, 2, master_addr="127.0.0.1", master_port=port)
    total = torch.tensor([2.0, 4.0, 6.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(json.dumps(total.tolist()), flush=True)


def test_init_distributed_store_listens_on_the_master_address_only(monkeypatch):
    from slime_hydra.train.backend import init_distributed

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = free_port()
    child = start_rank1(f"from tests.foundation.test_store_binding import _trainer_rank1; _trainer_rank1({port})")
    try:
        init_distributed(0, 2, master_addr="127.0.0.1", master_port=port)
    except BaseException:
        child.kill()
        raise
    try:
        assert listeners(port) == ["127.0.0.1"]
        assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ  # no side effect left behind
        total = torch.tensor([1.0, 2.0, 3.0])
        dist.all_reduce(total)
        assert total.tolist() == [3.0, 6.0, 9.0]
        assert finish(child) == [3.0, 6.0, 9.0]
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert listeners(port) == []
