"""An engine's first start survives losing its port: ``net.free_port`` picks a port free a moment ago, and another
process may bind it before the server does (CI once failed so, two test workers' processes on one machine; a
client's outgoing connection takes its local port the same way). The server exits with "address already in use"
and the actor starts it again on another port."""

import socket

from slime_hydra import net
from slime_hydra.rollout.engines import actor as actor_module
from slime_hydra.rollout.engines.actor import EngineActor
from tests.rollout.helpers import build_models


def test_a_first_start_whose_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    model, _, _ = build_models(tmp_path / "models")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: a probe of it is refused at once
        taken = held.getsockname()[1]
        picks = iter([taken])  # the first pick is the held port, the rest the OS's
        monkeypatch.setattr(actor_module, "free_port", lambda host: next(picks, None) or net.free_port(host))
        engine = EngineActor(0, str(model), str(tmp_path / "logs"), dtype="float32", max_batch_size=2)
        try:
            url = engine.start(timeout_s=120)
            assert engine.port != taken and url.endswith(f":{engine.port}") and engine.healthy()
        finally:
            engine.stop()
