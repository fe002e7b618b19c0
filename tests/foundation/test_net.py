"""net.py: the free port is bindable, and the retry wait grows, is capped and jittered within its bounds."""

import random
import socket

from slime_hydra.net import backoff_s, free_port


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def test_backoff_doubles_within_jitter_and_caps():
    random.seed(0)
    for attempt in range(8):
        nominal = min(4.0, 0.5 * 2 ** attempt)
        draws = [backoff_s(attempt, 0.5, cap_s=4.0, jitter=0.25) for _ in range(200)]
        assert all(0.75 * nominal <= d <= 1.25 * nominal for d in draws)
        assert max(draws) - min(draws) > 0.3 * nominal  # jittered, not a constant
    assert backoff_s(3, 1.0, jitter=0.0) == 8.0
    assert backoff_s(10, 1.0, cap_s=30.0, jitter=0.0) == 30.0
