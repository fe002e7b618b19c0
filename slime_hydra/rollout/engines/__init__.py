"""Rollout engines speaking SGLang's native HTTP protocol.

``embedded``: a transformers model behind that protocol (``python -m slime_hydra.rollout.engines.embedded``), for
CPU machines and small GPUs; ``process``: start/stop engine servers as child processes; ``weights``: the
weight-transfer helpers shared with the trainer side (process group, tensor payloads).
"""

from slime_hydra.rollout.engines.process import EngineProcess, ManagedProcess, free_port, start_embedded_engine

__all__ = ["EngineProcess", "ManagedProcess", "free_port", "start_embedded_engine"]
