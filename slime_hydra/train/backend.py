"""The training-backend protocol: what the loop asks of a training rank (train/group.py forwards each call to every
rank of the group, collectively), implemented by train=fsdp (train/fsdp.py) and train=megatron
(train/megatron/backend.py) with the same semantics.

    backend = Backend(model_path, train_cfg, total_steps, loss_agg, keep_reference, role="actor" | "critic" | "teacher")
    logp, entropy = backend.logprobs(batch, policy="current" | "ref", temperature, with_entropy)  # [B, T] on host
    metrics = backend.train_step(batch, loss_fn, temperature, with_entropy)  # one optimizer step; grad_norm, lr
    for hf_name, tensor in backend.iter_full_weights(): ...                  # weight sync, HF names, full tensors
    for key, tensor in backend.iter_adapter_weights(): ...                  # train.lora: A and B only (lora.py)
    backend.save(dir, background); backend.load(dir); backend.export_hf(dir)  # resumable checkpoint / HF export
    backend.load(dir, weights_only=True)                                    # the parameters alone (export.py)
    backend.export_adapter(dir)                                              # train.lora: a PEFT adapter directory
    seconds = backend.save_finished(wait)                                   # None while a background write runs
    backend.start_offload(); backend.offload(); backend.onload()             # colocated GPUs (train/offload.py)

With train.lora the base weights are frozen: ``iter_full_weights`` and ``export_hf`` give merged weights
(W + scale * B A), the reference policy is the base model (the adapter switched off), checkpoints hold the adapter
and its optimizer state only (the base loads from the model path).

``batch`` is this rank's share of the global batch (train/batch.TrainBatch: right-padded rows, response columns
[B, T]). A critic (PPO) returns its values V(s_j) from ``logprobs`` / ``values`` in place of logprobs. A teacher
(algo.objective=opd) is frozen: its weights in the compute dtype, no optimizer, ``logprobs`` of the current policy
only.
"""

import os
import random
from abc import abstractmethod
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from slime_hydra.train.batch import TrainBatch
from slime_hydra.train.checkpoint_writer import CheckpointWriter
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.precision import ComputeCopyBackend

ROLES = ("actor", "critic", "teacher")
"""What a backend instance is: the policy, PPO's value model, or on-policy distillation's frozen teacher."""


def is_frozen(role: str) -> bool:
    """Whether a backend of this role holds its weights frozen (the teacher: forward passes only, no optimizer);
    a role outside ROLES is refused."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role == "teacher"


LossFn = Callable[[torch.Tensor, torch.Tensor | None, TrainBatch], tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(logp [B,T], entropy [B,T] or None, micro_batch) -> (mean loss over the micro-batch's units, metrics)."""


def compile_options(train: TrainConfig) -> dict:
    """torch.compile's inductor options for the decoder layers: ``triton.cudagraphs`` with train.cuda_graphs (what
    mode "reduce-overhead" sets), and ``emulate_precision_casts`` with train.compile_eager_numerics: inside a fused
    chain of bf16 ops the compiled kernel rounds to bf16 after every op, as eager kernels do, instead of keeping
    fp32 in registers. The engines run the model eagerly, so the trainer then computes the distribution they
    sample from (docs/benchmarks.md, "train-vs-rollout mismatch")."""
    return {"triton.cudagraphs": train.cuda_graphs, "emulate_precision_casts": train.compile_eager_numerics}


def allow_recompiles(limit: int) -> None:
    """Let dynamo compile one code object (the decoder layer's forward) up to ``limit`` times: each layer type
    (dense / MoE), routing replay on / off (a guard on the routers' target) and static / dynamic shapes take one
    graph each; at the default 8 a compiled layer with fullgraph=True fails hard instead of running."""
    import torch._dynamo as dynamo

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), limit))


class TrainBackend(ComputeCopyBackend):
    """The protocol above; ``role`` is one of ROLES."""

    role: str
    train_cfg: TrainConfig
    _writer: CheckpointWriter | None = None

    def _computing(self):
        """Around each forward/backward block: the compute copies (precision.py) and, with train.cuda_graphs, a
        new CUDA-graph iteration (outputs of earlier graph replays are dead: their memory gets reused)."""
        if self.train_cfg.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return super()._computing()

    @abstractmethod
    def logprobs(self, batch: TrainBatch, policy: str = "current", temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] logprobs (and entropy) of the response tokens under the current or the reference policy."""

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic only: [B, T] values of the states before each response token."""
        if self.role != "critic":
            raise ValueError("values() needs role='critic'")
        return self.logprobs(batch)[0]

    @abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; returns averaged metrics + grad_norm, lr."""

    @abstractmethod
    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every HF state-dict entry. Collective."""

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """train.lora: (adapter key, full tensor) for every A and B matrix (train/lora.adapter_key). Collective."""
        raise ValueError("iter_adapter_weights needs train.lora.rank > 0")

    def export_adapter(self, out_dir: str | Path) -> None:
        """train.lora: a PEFT adapter directory of the current adapter (lora.write_adapter); rank 0 writes.
        Collective."""
        from slime_hydra.train.lora import write_adapter

        named = self.iter_adapter_weights()
        if dist.get_rank() == 0:
            write_adapter(out_dir, self.train_cfg.lora, named)
        else:
            for _ in named:  # the gathers are collective
                pass
        dist.barrier()

    @abstractmethod
    def export_hf(self, out_dir: str | Path) -> None:
        """An HF checkpoint (config + safetensors) of the current weights. Collective."""

    @abstractmethod
    def save(self, ckpt_dir: str | Path, background: bool = False) -> None:
        """A resumable checkpoint: model, optimizer, scheduler, step, RNG, reference. Collective. ``background``:
        copy the state to host memory now and write the files in a background thread (``save_finished`` says when
        they are on disk); else write them before returning. Either way a previous background write ends first."""

    @abstractmethod
    def load(self, ckpt_dir: str | Path, weights_only: bool = False) -> None:
        """Resume from ``save``'s checkpoint. Collective. ``weights_only``: the trained parameters alone (no optimizer,
        scheduler, step, RNG or reference), for an export (export.py); the layout may then differ where the
        parameters' shards do not (fsdp: any number of ranks; megatron: the same tp, pp and ep)."""

    @property
    def writer(self) -> CheckpointWriter:
        """This rank's background checkpoint writes (train/checkpoint_writer.py), made at the first save."""
        if self._writer is None:
            self._writer = CheckpointWriter()
        return self._writer

    def save_finished(self, wait: bool = False) -> float | None:
        """Seconds the last background write took once every file this rank wrote is fsynced; None while it is
        still writing (``wait``: block until it ends). Raises the write's error."""
        return self.writer.finished(wait)


def export_dtype(config) -> torch.dtype:
    """The dtype an HF export is written in: the one the run's starting checkpoint declares in its config.json
    (``dtype``, formerly ``torch_dtype``; a bf16 model comes out bf16, the rounding the engines' bf16 weights got
    too), fp32 when it declares none. The trainer's fp32 masters are rounded once, at the write."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype


class StepMetrics:
    """The loss callable's metrics over one optimizer step's micro-batches, on every data-parallel rank.

    ``add(metrics, weight)`` with weight = units(micro-batch) / units(global batch, all DP ranks), so the weighted
    sums over all micro-batches of all DP ranks are means over the global batch; metrics named ``*_max`` are maxima
    instead. Values stay device tensors until ``values()`` (one sync, after the optimizer step is queued).
    ``reduce(values, group)`` sums the means and maxes the maxima over the DP group."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.maxima: dict[str, torch.Tensor | float] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for name, value in metrics.items():
            value = value.detach() if torch.is_tensor(value) else value
            if name.endswith("_max"):
                prev = self.maxima.get(name)
                self.maxima[name] = value if prev is None else (
                    torch.maximum(prev, value) if torch.is_tensor(value) else max(prev, value))
            else:
                self.sums[name] = self.sums.get(name, 0.0) + value * weight

    def values(self) -> dict[str, float]:
        """This rank's weighted sums and maxima as floats (the one device sync)."""
        return {name: float(value) for name, value in {**self.sums, **self.maxima}.items()}

    @staticmethod
    def reduce(values: dict[str, float], group, device: torch.device) -> dict[str, float]:
        """Sum the weighted means and max the maxima over ``group`` (the data-parallel ranks)."""
        means = [n for n in values if not n.endswith("_max")]
        maxima = [n for n in values if n.endswith("_max")]
        out = {}
        for names, op in ((means, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
            if names:
                reduced = torch.tensor([values[n] for n in names], dtype=torch.float64, device=device)
                dist.all_reduce(reduced, op=op, group=group)
                out.update(zip(names, reduced.tolist()))
        return {name: out[name] for name in values}


def rng_state() -> dict:
    """Every RNG a step draws from (python, numpy, torch, CUDA): saved per rank with each checkpoint."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


NUMPY_ARRAY_GLOBALS = (np.zeros(0).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32)))
"""What rebuilding NumPy's RNG key (a uint32 array) from a checkpoint needs: numpy's array-reconstruction function
(wherever this numpy keeps it), the array and dtype classes. Numeric arrays only; nothing here runs other code."""


def load_rank_file(path: str | Path, map_location=None, mmap: bool = False) -> dict:
    """A checkpoint file this trainer wrote with ``torch.save`` (tensors, optimizer state, ``rng_state``), loaded
    with ``weights_only=True``: no arbitrary pickle, so a tampered checkpoint cannot run code. The only globals
    allowed beyond torch's own are ``NUMPY_ARRAY_GLOBALS`` (added to torch's allowlist for this process:
    ``add_safe_globals`` exists from torch 2.4, the ``safe_globals`` context only from 2.5). ``mmap``: tensors are
    read from disk only when touched."""
    torch.serialization.add_safe_globals(list(NUMPY_ARRAY_GLOBALS))
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def write_rank_file(state: dict, path: str | Path) -> None:
    """``torch.save`` of ``state`` to ``path``, fsynced: on disk when this returns (``load_rank_file`` reads it)."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def set_rng_state(state: dict) -> None:
    """Inverse of ``rng_state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500) -> None:
    """Join the trainer's process group: gloo for host tensors always, nccl for CUDA tensors when there is a GPU
    (the backends all-reduce small host tensors: loss units, metrics). Rank 0 hosts the group's store on the master
    address alone (``net.tcp_store``); MASTER_ADDR / MASTER_PORT, where set, win over the arguments, as they did
    when torch's ``env://`` rendezvous read them (scripts/probe_*.py pick their port that way)."""
    from slime_hydra.net import tcp_store

    host = os.environ.get("MASTER_ADDR", master_addr)
    port = int(os.environ.get("MASTER_PORT", master_port))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    store = tcp_store(host, port, rank, world_size, dist.default_pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
