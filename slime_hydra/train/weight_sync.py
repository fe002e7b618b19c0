"""Weight sync: the trainer's current weights into every rollout engine, as a new weight version.

Run on every training rank at once (gathering full tensors is collective); rank 0 does the sending. The method is
``train.weight_sync`` with ``auto`` resolved (``Derived.weight_sync``, config/derive.py):

- **distributed**: trainer rank 0 and every engine form one broadcast group (gloo on CPU, NCCL on GPU; made once,
  at the first sync). Tensors go in buckets of at most ``train.weight_sync_bucket_mb``: for each bucket rank 0
  asks the rollout manager to announce it to the engines (``/update_weights_from_distributed`` with the names,
  dtypes and shapes) and broadcasts the tensors in that order; the engines load them as they arrive.
- **tensor**: the colocated path. On GPUs every rank copies the bucket into one flat buffer on its GPU and shares
  a CUDA IPC handle to it (``weight_transport.share_cuda_bucket``); rank 0 collects the handles and the manager
  hands them to ``/update_weights_from_tensor`` (``load_format: cuda_ipc``): each engine copies, device to
  device, from the buffer on its own GPU, and only ~1 KB of JSON per bucket goes through Ray and HTTP. On CPU the
  buckets travel through Ray's object store as tensors and reach the engines as base64 safetensors.
- **disk**: the trainer exports an HF checkpoint to ``<run_dir>/weights/latest`` and the engines reload it with
  ``/update_weights_from_disk``.

With train.lora and ``Derived.lora_sync`` = adapter only the A and B matrices travel (``iter_adapter_weights``,
under their saved-adapter keys, in fp32 as the trainer computes them); the engines add them to the base they keep.
By broadcast or tensor they overwrite the engine's own adapter in place; by disk the trainer writes a PEFT adapter
directory, ``<run_dir>/weights/adapter_v<version>``, that every engine loads as a named adapter (SGLang's
``/load_lora_adapter``: rollout/weight_relay.py), and once the sync is done the older directories are removed (the
engines hold what they loaded). Merged LoRA weights travel as any.

Every sync: generation held in place (``begin_weight_update``), the buckets, then ``finish_weight_update`` (flush
caches, resume, advance the buffer's version). The last bucket carries the version, so an engine reports the new
version only once it has every tensor. Tensors are sent in the engines' compute dtype (``Derived.engine_dtype``).
"""

import shutil
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

import ray
import torch
import torch.distributed as dist

from slime_hydra.net import free_port
from slime_hydra.weight_transport import (
    buckets, destroy_weight_update_group, dtype_from_name, dtype_name, init_weight_update_group, send_named_tensors,
    share_cuda_bucket,
)

ADAPTER_DIR = "adapter_v"
"""Prefix of the PEFT adapter directory of each adapter sync by disk (``<run_dir>/weights/adapter_v<version>``)."""
SYNC_ATTEMPTS = 2
"""A sync that failed while an engine died is run once more, without it (``WeightPusher.push``)."""
ENGINES_SETTLE_S = 60.0
"""After a failed broadcast, how long rank 0 waits for the engines' side of the bucket to end before aborting."""


class WeightPusher:
    """Lives on one training rank; ``push`` is called on all ranks together, once per sync.

    Only rank 0 talks to the rollout manager. Its calls go through ``_on_rank0``: once one fails the rest of the
    attempt skips them, while every rank still runs the attempt's collectives (gathering full tensors, CUDA IPC
    handles), so a failure on rank 0 never leaves the others waiting in a collective. At the end of an attempt rank
    0 tells every rank the outcome: done, again, or failed."""

    def __init__(self, backend, method: str, manager, bucket_mb: int, run_dir: str, dtype: str,
                 adapter: bool = False):
        """method: ``Derived.weight_sync``; dtype: the engines' (``Derived.engine_dtype``, a torch dtype name);
        adapter: send the LoRA adapter alone (``Derived.lora_sync`` = adapter)."""
        self.backend, self.method, self.manager, self.adapter = backend, method, manager, adapter
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.run_dir, self.send_dtype = Path(run_dir), dtype_from_name(dtype)
        self.rank = dist.get_rank()
        self.group = None
        self._failure: Optional[BaseException] = None
        """Rank 0: the first error of this attempt's calls to the manager (the rest of the attempt skips them)."""

    def push(self, version: int) -> dict[str, float]:
        """Send the current weights as ``version``; returns {"sync/bytes": n, "sync/attempts": k}.

        An attempt that fails while engines died during it (``abort_weight_update`` names them) is run again: the
        dead engines are out of service by then and get the weights when they are back (the relay's replay, or the
        next sync). Any other failure, or a second one, is raised on every rank."""
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            self._failure = None
            self._on_rank0(lambda: ray.get(self.manager.begin_weight_update.remote()))
            sent = self._send_all(version)
            self._on_rank0(lambda: ray.get(self.manager.finish_weight_update.remote(version)))
            outcome = ["done" if self._failure is None else "failed", sent]
            if self.rank == 0 and self._failure is not None:  # generation resumes, the relay's lock is released
                lost = ray.get(self.manager.abort_weight_update.remote())
                if lost and attempt < SYNC_ATTEMPTS:
                    outcome[0] = "again"
                    print(f"weight sync: version {version} failed while engine(s) {lost} died "
                          f"({type(self._failure).__name__}: {self._failure}); sending it again", flush=True)
            dist.broadcast_object_list(outcome, src=0)
            if outcome[0] == "done":
                return {"sync/bytes": float(outcome[1]), "sync/attempts": float(attempt)}
            if outcome[0] == "failed":
                if self.rank == 0:
                    raise self._failure
                raise RuntimeError(f"weight sync of version {version} failed on trainer rank 0 (its error says why)")
        raise AssertionError("unreachable: the last attempt is done or failed")

    def _on_rank0(self, call: Callable[[], object]) -> None:
        """Rank 0 makes ``call`` (a call to the rollout manager) unless one failed earlier in this attempt; a
        failure is kept for ``push``, not raised, so the attempt's collectives still run on every rank."""
        if self.rank != 0 or self._failure is not None:
            return
        try:
            call()
        except Exception as error:
            self._failure = error

    def _send_all(self, version: int) -> int:
        """Every tensor to the engines by this method; returns the bytes sent (rank 0's count)."""
        sent = 0
        if self.method == "disk" and self.adapter:
            out = self.run_dir / "weights" / f"{ADAPTER_DIR}{version}"
            self.backend.export_adapter(out)
            self._on_rank0(lambda: ray.get(self.manager.load_adapter_from_disk.remote(str(out), version)))
            if self.rank == 0 and self._failure is None:
                sent = (out / "adapter_model.safetensors").stat().st_size
                for old in out.parent.glob(f"{ADAPTER_DIR}*"):
                    if old != out:
                        shutil.rmtree(old)
        elif self.method == "disk":
            out = self.run_dir / "weights" / "latest"
            out.mkdir(parents=True, exist_ok=True)
            self.backend.export_hf(out)
            self._on_rank0(lambda: ray.get(self.manager.update_weights_from_disk.remote(str(out), version)))
            if self.rank == 0:
                sent = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        else:
            if self.method == "distributed":
                self._on_rank0(self._join_group)
            bucket_list = buckets(self._tensors(), self.bucket_bytes)
            pending = next(bucket_list, None)
            while pending is not None:
                following = next(bucket_list, None)
                sent += self._send(pending, version if following is None else None)
                pending = following
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # free shared buffers the engines have let go of
        return sent

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.adapter:
            yield from self.backend.iter_adapter_weights()
            return
        for name, tensor in self.backend.iter_full_weights():
            yield name, tensor.to(self.send_dtype) if tensor.is_floating_point() else tensor

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version) -> int:
        """Hand one bucket to the engines (rank 0 talks to the manager; the CUDA IPC path needs every rank)."""
        if self.method == "tensor" and bucket[0][1].is_cuda:
            flat, handle = share_cuda_bucket(bucket)
            handles = [None] * dist.get_world_size()
            dist.all_gather_object(handles, handle)
            self._on_rank0(lambda: ray.get(self.manager.update_weights_from_cuda_ipc.remote(handles, version)))
            dist.barrier()  # every engine has copied out of every rank's buffer: now it may go
            del flat
        elif self.rank != 0:
            return 0
        elif self.method == "tensor":
            self._on_rank0(lambda: ray.get(self.manager.update_weights_from_tensor.remote(
                {n: t.cpu() for n, t in bucket}, version)))
        else:
            self._on_rank0(lambda: self._broadcast(bucket, version))
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]], version) -> None:
        """Announce one bucket to the engines and broadcast it. When the broadcast fails (a member died) this side
        leaves the group at once, so the other members' receive fails too instead of waiting out the group's
        timeout, and the next attempt forms a new group. Leaving means the group object is freed: its connections
        close only then, and the failed send's frames (kept by the error's traceback) hold it, so their locals are
        cleared first. Kept, they held the survivors in their receive for the whole ENGINES_SETTLE_S (60 s a failed
        sync, measured on the CPU machine; now under 1 s)."""
        ref = self.manager.update_weights_from_distributed.remote(
            [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket],
            version)
        try:
            send_named_tensors(self.group, bucket)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)  # their locals hold the group (its connections open)
            destroy_weight_update_group(self.group)
            self.group = None
            try:
                ray.get(ref, timeout=ENGINES_SETTLE_S)
            except Exception:  # the engines' side of the same failure: the send's error is the one raised
                pass
            raise
        ray.get(ref)

    def _join_group(self) -> None:
        """Rank 0 hosts the broadcast group; the manager makes every engine join it (rank 1 + engine index).
        Formed at the first sync, and again after an engine restarted (the group lost a member)."""
        if self.rank != 0:
            return
        if self.group is not None:
            if not ray.get(self.manager.weight_group_stale.remote()):
                return
            destroy_weight_update_group(self.group)
            self.group = None
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        world = ray.get(self.manager.weight_group_size.remote())
        joined = self.manager.init_weight_sync.remote(host, port, backend)
        self.group = init_weight_update_group(host, port, 0, world, backend=backend)
        ray.get(joined)
