"""Rollout engines speaking SGLang's native HTTP protocol.

``embedded``: a transformers model behind that protocol (``python -m slime_hydra.rollout.engines.embedded``), for
CPU machines and small GPUs; ``sglang``: the command line of real SGLang servers; ``process``: start/stop engine
servers as child processes; ``actor``: the Ray actor that owns one engine; ``weights``: the weight-transfer helpers
shared with the trainer side (process group, tensor payloads).
"""

from slime_hydra.rollout.engines.process import (
    EngineProcess, ManagedProcess, ServerProcess, embedded_command, start_embedded_engine,
)

__all__ = ["EngineProcess", "ManagedProcess", "ServerProcess", "embedded_command", "start_embedded_engine"]
