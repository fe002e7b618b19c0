"""``EngineActor``: a Ray actor that owns one engine server process on the GPUs of its placement-group bundle.

The actor holds the bundle's resources (so Ray's placement decides which GPUs an engine gets) and starts the
server as a child process with ``CUDA_VISIBLE_DEVICES`` set to the GPU ids Ray assigned. The server itself runs
outside Ray's accounting, as SGLang does under slime. On a CPU-only machine the bundle is ``{CPU: 1}`` and the
engine runs on the CPU.

    actor.start() -> url     actor.restart() -> url (same port)     actor.alive() -> bool     actor.stop()

Only ``rollout=embedded`` servers are started here: real SGLang servers need the ``sglang`` extra on a GPU
cluster (``rollout/engines/sglang.py`` renders their command line; see docs/rollout.md).
"""

import os
from pathlib import Path
from typing import Optional

import ray

from slime_hydra.rollout.engines.process import EngineProcess


class EngineActor:
    def __init__(self, index: int, model_path: str, log_dir: str, dtype: str = "auto", max_batch_size: int = 256,
                 torch_threads: Optional[int] = None):
        self.index, self.model_path, self.dtype = index, model_path, dtype
        self.max_batch_size, self.log_dir = max_batch_size, Path(log_dir)
        self.torch_threads = torch_threads
        self.process: Optional[EngineProcess] = None
        self.port: Optional[int] = None

    def _env(self) -> dict:
        env = dict(os.environ)
        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        return env

    def start(self, timeout_s: float = 300.0) -> str:
        """Start the server and return its URL once /health answers."""
        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        device = "cuda" if gpu_ids else "cpu"
        host = ray.util.get_node_ip_address() if ray.is_initialized() and not _local_only() else "127.0.0.1"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.process = EngineProcess(
            self.model_path, host=host, port=self.port, device=device, dtype=self.dtype,
            max_batch_size=self.max_batch_size, log_path=self.log_dir / f"engine_{self.index}.log", env=self._env())
        self.port = self.process.port
        self.process.start().wait_healthy(timeout_s)
        return self.process.url

    def restart(self, timeout_s: float = 300.0) -> str:
        """Stop whatever is left of the server and start a fresh one on the same port (initial weights)."""
        self.stop()
        return self.start(timeout_s)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _local_only() -> bool:
    """One-machine runs bind engines to loopback (never a routable address unless the cluster spans nodes)."""
    return len(ray.nodes()) <= 1
