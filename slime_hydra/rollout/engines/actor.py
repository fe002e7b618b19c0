"""``EngineActor``: a Ray actor that owns one engine server process on the GPUs of its placement-group bundle.

The actor holds a share of its first bundle (so Ray's placement decides where an engine runs) and starts the
server as a child process with ``CUDA_VISIBLE_DEVICES`` set to the engine's GPUs. The server itself runs outside
Ray's accounting, as SGLang does under slime. An engine of ``rollout.gpus_per_engine`` > 1 GPUs (SGLang TP) spans
that many consecutive one-GPU bundles: ``engine_gpu_ids`` asks each bundle which GPU Ray gave it (a tiny probe task
per bundle, before the engines start) and refuses an engine whose bundles landed on different nodes. On a CPU-only
machine the bundle is ``{CPU: 1}`` and the engine runs on the CPU.

    actor.start(api_key) -> url   actor.restart() -> url (same ports, same key)   actor.alive() -> bool   actor.stop()

``EngineSpec`` is how a run makes its engine actors: the loop makes the configured ones on their bundles, and the
rollout manager makes one more from the same spec when an engine is added while the run goes on (elastic).

Which server: the embedded engine (``sglang=None``, ``rollout=embedded``), or real SGLang (an ``SGLangLaunch``,
``rollout=sglang``: ``python -m sglang.launch_server ...`` rendered by ``engines/sglang.py``; it needs the
``sglang`` extra on a GPU node). Both run through the same ``ServerProcess``: same log file
(``<log_dir>/engine_<index>.log``, first line the command), same readiness check (``GET /health_generate``), same
stop (SIGTERM, then SIGKILL, to the server's process group).

The run's API key (rollout/auth.py) reaches the server off its command line: the embedded engine reads it from its
environment, SGLang from a YAML file named by ``--config`` that the actor writes with mode 0600 in a private
directory of its own (``tempfile.mkdtemp``: mode 0700) on the engine's node, and removes when the server stops.
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ray

from slime_hydra.net import PORT_ATTEMPTS, free_port
from slime_hydra.rollout.auth import API_KEY_ENV, write_private
from slime_hydra.rollout.engines.process import ServerProcess, embedded_command
from slime_hydra.rollout.engines.sglang import SGLangLaunch, api_key_config

EMBEDDED_START_TIMEOUT_S = 300.0
"""Seconds an embedded engine may take to load and answer /health_generate."""
SGLANG_START_TIMEOUT_S = 1200.0
"""Seconds an SGLang server may take (weights from shared storage, CUDA-graph capture, warm-up)."""


class EngineActor:
    def __init__(self, index: int, model_path: str, log_dir: str, dtype: str = "auto", max_batch_size: int = 256,
                 torch_threads: Optional[int] = None, sglang: Optional[SGLangLaunch] = None,
                 gpu_ids: Optional[list[str]] = None, lora: Optional[dict] = None,
                 return_routed_experts: bool = False, batch_invariant: bool = False):
        """index: engine number (log name, SGLang seed offset); dtype, max_batch_size, torch_threads: embedded
        engine only; sglang: start this SGLang server instead of the embedded engine; gpu_ids: the engine's GPUs
        (``engine_gpu_ids``; default: the ones Ray assigned to this actor); lora: the embedded engine serves the
        model with these LoRA adapters (a PEFT adapter config; train.lora with adapter sync); return_routed_experts:
        the embedded engine reports every token's experts (algo.routing_replay); batch_invariant: the embedded
        engine computes every token as the batch-invariant trainer does (algo.true_on_policy)."""
        self.index, self.model_path, self.dtype = index, model_path, dtype
        self.gpu_ids = gpu_ids
        self.max_batch_size, self.log_dir = max_batch_size, Path(log_dir)
        self.torch_threads = torch_threads
        self.sglang = sglang
        self.lora = lora
        self.return_routed_experts = return_routed_experts
        self.batch_invariant = batch_invariant
        self.process: Optional[ServerProcess] = None
        self.port: Optional[int] = None
        self.nccl_port: Optional[int] = None
        self.api_key: Optional[str] = None
        """The run's key the server requires (set by ``start``, kept for restarts)."""
        self._key_dir: Optional[str] = None

    def _env(self, gpu_ids: list[str]) -> dict:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.api_key and self.sglang is None:
            env[API_KEY_ENV] = self.api_key
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        return env

    def command(self, host: str, gpu_ids: list[str]) -> list[str]:
        """The server's argv on ``host`` (ports are picked on first use and kept across restarts)."""
        self.port = self.port or free_port(host)
        if self.sglang is None:
            device = "cuda" if gpu_ids else "cpu"
            extra = ["--lora-config", json.dumps(self.lora)] if self.lora else []
            extra += ["--enable-return-routed-experts"] if self.return_routed_experts else []
            extra += ["--batch-invariant"] if self.batch_invariant else []
            return embedded_command(self.model_path, host, self.port, device, self.dtype, self.max_batch_size, extra)
        if len(gpu_ids) != self.sglang.tp_size:
            raise RuntimeError(f"engine {self.index} holds GPUs {gpu_ids} from its Ray placement but SGLang runs "
                               f"--tp-size {self.sglang.tp_size} (rollout.gpus_per_engine): the engine actor must "
                               f"be given exactly rollout.gpus_per_engine GPUs")
        self.nccl_port = self.nccl_port or free_port(host)
        return self.sglang.command(self.index, host, self.port, self.nccl_port, config=self._sglang_config())

    def _sglang_config(self) -> Optional[str]:
        """The private YAML file that gives SGLang the key (None without a key)."""
        if not self.api_key:
            return None
        self._key_dir = self._key_dir or tempfile.mkdtemp(prefix=f"slime_hydra_engine_{self.index}_")
        return str(write_private(Path(self._key_dir) / "api_key.yaml", api_key_config(self.api_key)))

    def start(self, api_key: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        """Start the server and return its URL once /health_generate answers 200. api_key: the run's key the server
        will require (None: none); timeout_s: default EMBEDDED_START_TIMEOUT_S or SGLANG_START_TIMEOUT_S. A server
        that exits because its port was taken meanwhile starts again on another (net.PORT_ATTEMPTS in all; a restart
        keeps its port: the router knows the engine by its address)."""
        self.api_key = api_key
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start(timeout_s)
            except RuntimeError as error:
                if "address already in use" not in str(error).lower():
                    raise
                print(f"engine {self.index}: port {self.port} was taken before the server bound it; trying another",
                      flush=True)
                self.port = self.nccl_port = None
        return self._start(timeout_s)

    def _start(self, timeout_s: Optional[float]) -> str:
        gpu_ids = self.gpu_ids if self.gpu_ids is not None else _gpu_ids()
        host = ray.util.get_node_ip_address() if ray.is_initialized() and not _local_only() else "127.0.0.1"
        argv = self.command(host, gpu_ids)
        self.process = ServerProcess(f"engine_{self.index}", argv, host, self.port,
                                     self.log_dir / f"engine_{self.index}.log", self._env(gpu_ids))
        if timeout_s is None:
            timeout_s = EMBEDDED_START_TIMEOUT_S if self.sglang is None else SGLANG_START_TIMEOUT_S
        try:
            self.process.start().wait_healthy(timeout_s)
        except BaseException:
            self.process.stop()
            raise
        return self.process.url

    def restart(self, timeout_s: Optional[float] = None) -> str:
        """Stop whatever is left of the server and start a fresh one on the same port and key (initial weights)."""
        self.stop()
        return self._start(timeout_s)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def healthy(self) -> bool:
        """The server process runs and answers /health_generate with 200."""
        return self.alive() and self.process.healthy()

    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    def node_id(self) -> str:
        """The Ray node this engine runs on (hex id): the pool drops the engine when that node leaves
        (rollout.elastic)."""
        return ray.get_runtime_context().get_node_id()

    def describe(self) -> str:
        """The server process in a few words, for an error: ``pid P running``, or ``pid P exited with code C``
        and the last line of its log."""
        if self.process is None or self.process.popen is None:
            return "no process started"
        if self.process.alive:
            return f"pid {self.process.pid} running"
        lines = [line for line in self.process.log_tail(2000).splitlines() if line.strip()]
        return (f"pid {self.process.pid} exited with code {self.process.popen.returncode}"
                + (f"; its log ends: {lines[-1].strip()}" if lines else ""))

    def log_path(self) -> Optional[str]:
        return str(self.process.log_path) if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None


@dataclass
class EngineSpec:
    """The run's engine actors' arguments but the index and the GPUs (``EngineActor.__init__``'s model_path,
    log_dir, dtype, max_batch_size, torch_threads, sglang, lora, return_routed_experts, batch_invariant)."""
    kwargs: dict

    def make(self, index: int, num_gpus: float, scheduling_strategy=None, gpu_ids: Optional[list[str]] = None):
        """Engine actor ``index`` holding ``num_gpus`` of Ray's GPUs (0 on CPU) and no CPU: on its bundle
        (``scheduling_strategy``, with the bundle's ``gpu_ids``), or wherever Ray finds the GPUs free (None)."""
        options = {"num_cpus": 0, "num_gpus": num_gpus}
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        return ray.remote(EngineActor).options(**options).remote(index, gpu_ids=gpu_ids, **self.kwargs)


def engine_gpu_ids(pg, first_bundle: int, num_engines: int, gpus_per_engine: int) -> list[list[str]]:
    """The GPU ids of each engine: engine i spans bundles ``first_bundle + i * gpus_per_engine`` onwards, one GPU
    each. Raises if an engine's bundles are on different nodes (TP needs one node)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def probe() -> tuple[str, list[str]]:
        return ray.util.get_node_ip_address(), _gpu_ids()

    count = num_engines * gpus_per_engine
    where = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=first_bundle + b)).remote() for b in range(count)])
    engines = []
    for i in range(num_engines):
        own = where[i * gpus_per_engine:(i + 1) * gpus_per_engine]
        nodes = sorted({node for node, _ in own})
        if len(nodes) > 1:
            raise RuntimeError(f"engine {i}'s {gpus_per_engine} GPUs landed on nodes {nodes}; an engine's TP group "
                               "must be on one node: make rollout.gpus_per_engine divide cluster.gpus_per_node and "
                               "train.num_gpus a multiple of cluster.gpus_per_node")
        engines.append([gpu for _, ids in own for gpu in ids])
    return engines


def _gpu_ids() -> list[str]:
    """GPU ids Ray assigned to this actor (none outside Ray, or on a CPU-only bundle)."""
    if not ray.is_initialized():
        return []
    return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def _local_only() -> bool:
    """One-machine runs bind engines to loopback (never a routable address unless the cluster spans nodes)."""
    return len(ray.nodes()) <= 1
