"""The train group: one Ray actor per training rank, together one torch.distributed group.

    group = TrainGroup(placement_group, num_ranks, backend, model_path, train_cfg, total_steps, loss_agg,
                       keep_reference)
    logp, entropy = group.logprobs(batch, policy="current")      # [B, T], reassembled in batch order
    teacher_logp, _ = group.logprobs(batch, policy="teacher")      # teacher_path given: the distillation teacher's
    values = critic_group.values(batch)                            # role="critic": [B, T] values
    metrics = group.train_step(batch, loss_fn)                     # one optimizer step on the whole batch
    group.push_weights(version)                                    # into the engines (train/weight_sync.py)
    group.call("save", dir, background); group.call("export_hf", dir)   # any backend method, on every rank

The batch goes to the object store once; each data-parallel rank takes its share of the rows (``batch.dp_shares``:
equal row counts, balanced token counts), so every rank of one model replica (TP/PP peers in Megatron) sees the same
rows. One bundle per rank: {GPU: 1} on a
GPU cluster, {CPU: 1} on a CPU-only machine.

On-policy distillation's teacher lives in the actor's ranks (``teacher_path``): a second, frozen backend instance
(role="teacher") over the same process group and parallel layout, so its share of a batch is the actor's, and it
moves to the host and back with the actor's state when colocated engines take the GPU (``MOVES``).
"""

import importlib
import os
from pathlib import Path
from typing import Callable

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_hydra.net import free_port
from slime_hydra.train.batch import TrainBatch, dp_shares
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS



MOVES = ("start_offload", "offload", "onload", "onload_fits")
"""The colocated moves (train/offload.py) a rank's teacher makes with its actor."""


class TrainRank:
    """One training rank. Created through ray.remote by TrainGroup; the process group forms in ``setup``."""

    teacher = None
    """The frozen teacher backend of on-policy distillation (role="teacher"), or None."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port for the process group's rendezvous (asked of rank 0)."""
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, rank: int, world: int, master: tuple[str, int], backend: str, model_path: str,
              train: TrainConfig, total_steps: int, loss_agg: str, keep_reference: bool, role: str,
              torch_threads: int | None, batch_invariant: bool = False, deterministic: bool = False,
              teacher_path: str | None = None) -> None:
        from slime_hydra.train.backend import init_distributed

        if deterministic:  # deterministic=true: kernels that add in a fixed order (cuBLAS reads its variable at init)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        assigned = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
        torch.set_num_threads(torch_threads or max(assigned, 1))
        init_distributed(rank, world, master_addr=master[0], master_port=master[1])
        module, name = TRAIN_BACKEND_KINDS[backend].cls.rsplit(".", 1)  # a rank imports its one backend
        Backend = getattr(importlib.import_module(module), name)
        kwargs = {"role": role} if role != "actor" else {}
        if batch_invariant:  # algo.true_on_policy (a backend whose record allows it: config/rules.py)
            kwargs["batch_invariant"] = True
        self.backend = Backend(model_path, train, total_steps, loss_agg=loss_agg, keep_reference=keep_reference,
                               **kwargs)
        if teacher_path is not None:
            self.teacher = Backend(teacher_path, train, 0, loss_agg=loss_agg, role="teacher")
        self.pusher = None

    def _share(self, batch: TrainBatch) -> tuple[list[int], TrainBatch]:
        rows = dp_shares(batch, self.backend.dp_size)[self.backend.dp_rank]
        return rows, batch.select(rows)

    def logprobs(self, batch: TrainBatch, policy: str, temperature: float, with_entropy: bool):
        rows, share = self._share(batch)
        backend, policy = (self.teacher, "current") if policy == "teacher" else (self.backend, policy)
        logp, entropy = backend.logprobs(share, policy, temperature, with_entropy)
        return rows, logp, entropy

    def values(self, batch: TrainBatch):
        rows, share = self._share(batch)
        return rows, self.backend.values(share), None

    def train_step(self, batch: TrainBatch, loss_fn: Callable, temperature: float, with_entropy: bool) -> dict:
        return self.backend.train_step(self._share(batch)[1], loss_fn, temperature, with_entropy)

    def call(self, method: str, *args):
        """Run a backend method by name on this rank (save, load, export_hf: all collective); the colocated moves
        (``MOVES``) move the teacher too."""
        if self.teacher is None or method not in MOVES:
            return getattr(self.backend, method)(*args)
        if method == "onload_fits":  # both come back at once
            return self.backend.onload_fits(self.teacher.offloaded_bytes)
        getattr(self.backend, method)(*args)
        return getattr(self.teacher, method)(*args)  # offload / onload: the process's GPU bytes, after both moved

    def connect_rollout(self, method: str, manager, bucket_mb: int, run_dir: str, dtype: str, adapter: bool) -> None:
        """Set up weight sync to the rollout manager's engines (train/weight_sync.py)."""
        from slime_hydra.train.weight_sync import WeightPusher

        self.pusher = WeightPusher(self.backend, method, manager, bucket_mb, run_dir, dtype, adapter)

    def push_weights(self, version: int) -> dict:
        return self.pusher.push(version)


class TrainGroup:
    def __init__(self, pg: PlacementGroup, num_ranks: int, backend: str, model_path: str | Path, train: TrainConfig,
                 total_steps: int, loss_agg: str, keep_reference: bool, gpus_per_rank: float = 0.0,
                 bundle_offset: int = 0, role: str = "actor", cpus_per_rank: float = 1.0,
                 torch_threads: int | None = None, batch_invariant: bool = False, deterministic: bool = False,
                 teacher_path: str | Path | None = None):
        """torch_threads: CPU threads of each rank's torch ops; None means the CPUs Ray assigned it.
        batch_invariant: the ranks' forward is the batch-invariant one (algo.true_on_policy).
        deterministic: the ranks run torch's deterministic algorithms (deterministic=true).
        teacher_path: on-policy distillation's teacher checkpoint, held frozen by every rank (``policy="teacher"``)."""
        actor_cls = ray.remote(TrainRank)
        self.ranks = [
            actor_cls.options(
                num_cpus=0 if gpus_per_rank else cpus_per_rank, num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_offset + i),
            ).remote()
            for i in range(num_ranks)
        ]
        master = ray.get(self.ranks[0].address.remote())
        ray.get([r.setup.remote(i, num_ranks, master, backend, str(model_path), train, total_steps, loss_agg,
                                keep_reference, role, torch_threads, batch_invariant, deterministic,
                                str(teacher_path) if teacher_path is not None else None)
                 for i, r in enumerate(self.ranks)])

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """A critic group's [B, T] values V(s_j) of the states before each response token, in batch order."""
        ref = ray.put(batch)
        return self._assemble(batch, ray.get([r.values.remote(ref) for r in self.ranks]), False)[0]

    def logprobs(self, batch: TrainBatch, policy: str = "current", temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        ref = ray.put(batch)
        parts = ray.get([r.logprobs.remote(ref, policy, temperature, with_entropy) for r in self.ranks])
        return self._assemble(batch, parts, with_entropy)

    @staticmethod
    def _assemble(batch: TrainBatch, parts: list, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's (rows, [rows, T'] values, entropy) put back in batch order as [B, T]."""
        logp = torch.zeros(batch.loss_mask.shape)
        entropy = torch.zeros(batch.loss_mask.shape) if with_entropy else None
        for rows, lp, ent in parts:  # TP/PP peers return the same rows; writing them twice is harmless
            logp[rows, : lp.shape[1]] = lp
            if with_entropy:
                entropy[rows, : ent.shape[1]] = ent
        return logp, entropy

    def train_step(self, batch: TrainBatch, loss_fn: Callable, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        ref = ray.put(batch)
        return ray.get([r.train_step.remote(ref, loss_fn, temperature, with_entropy) for r in self.ranks])[0]

    def call(self, method: str, *args) -> list:
        return ray.get([r.call.remote(method, *args) for r in self.ranks])

    def connect_rollout(self, method: str, manager, bucket_mb: int, run_dir: str, dtype: str,
                        adapter: bool = False) -> None:
        """method: ``Derived.weight_sync``; dtype: ``Derived.engine_dtype`` (the engines' compute dtype); adapter:
        the LoRA adapter alone (``Derived.lora_sync``)."""
        ray.get([r.connect_rollout.remote(method, manager, bucket_mb, run_dir, dtype, adapter) for r in self.ranks])

    def push_weights(self, version: int) -> dict[str, float]:
        """Weights of the current policy into every engine as ``version`` (train/weight_sync.py)."""
        return ray.get([r.push_weights.remote(version) for r in self.ranks])[0]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
