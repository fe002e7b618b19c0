"""train=megatron's resumable checkpoints (MegatronBackend.save / load).

Per (PP stage, TP rank; and EP rank when ep > 1), the trainable parameters' shards (with train.lora: the adapters
and trained biases; the frozen base reloads from the model path) and the optimizer's (written by the slot's rank
with DP and CP rank 0: CP and DP peers hold identical shards; with ep > 1 by its rank of expert-data-parallel rank 0,
one file per EP rank, as they differ in their experts; EP ranks are DP and CP ranks, so that writer may have CP
rank 1; with ep > 1 the optimizer state of the experts only, that of the dense parameters, which the ZeRO optimizer
shards over all DP x CP peers, in one file per (PP stage, TP rank) written by DP x CP rank 0), scheduler and step,
and every rank's RNG state; resume needs the same world size, tp, pp and ep (cp and dp may be traded). To change
tp, pp or ep, export_hf and start a new run from the export (optimizer state is not carried).
"""

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

from slime_hydra.durable import write_json
from slime_hydra.train.backend import load_rank_file, rng_state, set_rng_state, write_rank_file
from slime_hydra.train.optim import consolidate, continue_schedule, optimizers
from slime_hydra.train.reference import host_copy, pinned


def save(backend, ckpt_dir: str | Path, background: bool = False) -> None:
    """Resumable checkpoint of ``backend`` (a MegatronBackend): this (PP stage, TP rank) slot's parameters, optimizer
    and reference shards; scheduler, step; every rank's RNG. Collective (the ZeRO consolidation; the barrier of a
    write in the foreground). ``background``: parameters, optimizer state and RNG states are staged into host memory
    (CheckpointWriter.stage) and the files written by the writer's thread; the reference shards, which never change,
    are written from the copy the backend keeps on the host."""
    from megatron.core import tensor_parallel

    backend.writer.finished(wait=True)  # the stager's buffers still feed a running write until it ends
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank, slot_path, ref = dist.get_rank(), ckpt_dir / _slot_file(backend), backend._ref_shards
    consolidate(backend.optimizer)  # every peer's share of the Adam state, gathered on the peer that writes
    # CP and DP peers hold the same shards; EP peers (DP and CP ranks of a stage) differ in their experts: one
    # writer per expert-data-parallel group, i.e. per (PP stage, TP rank, EP rank)
    writes_slot = (backend.cp_rank == 0 and backend.dp_rank == 0 if backend.ep_size == 1
                   else dist.get_rank(backend.expert_dp_group) == 0)
    writes_dense = backend.ep_size > 1 and dist.get_rank(backend.dp_cp_group) == 0
    parts = optimizers(backend.optimizer)  # ep > 1: [dense parameters, this rank's experts (if it trains any)]
    slot = ({"model": {n: p.detach() for n, p in backend._local_shards().items()},
             "optim": (backend.optimizer.state_dict() if backend.ep_size == 1
                       else parts[1].state_dict() if len(parts) > 1 else None)} if writes_slot else {})
    dense = {"optim": parts[0].state_dict()} if writes_dense else {}
    local = {"rng": rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    meta = copy.deepcopy({"step": backend.step, "scheduler": backend.scheduler.state_dict(),
                          "world": dist.get_world_size(), "tp": backend.tp_size, "pp": backend.pp_size,
                          "cp": backend.cp_size, "ep": backend.ep_size})
    if background:
        slot, dense, local = backend.writer.stage((slot, dense, local))
    elif writes_slot:
        slot["model"] = host_copy(slot["model"])

    def write() -> None:
        if writes_slot:
            write_rank_file({**slot, "ref": ref}, slot_path)
        if writes_dense:
            write_rank_file(dense, ckpt_dir / _dense_file(backend))
        write_rank_file(local, ckpt_dir / f"rank{rank}.pt")
        if rank == 0:
            write_json(ckpt_dir / "trainer.json", meta)

    if background:
        backend.writer.start(ckpt_dir, write)
    else:
        write()
        dist.barrier()


def load(backend, ckpt_dir: str | Path, weights_only: bool = False) -> None:
    """Resume from ``save``'s checkpoint: parameters, optimizer, reference shards, scheduler, step, RNG.
    ``weights_only``: the parameters alone (an export), by any number of ranks with the saving run's tp, pp and ep
    (DP and CP peers hold the same shards); the files are memory-mapped, so the optimizer state is never read."""
    from megatron.core import tensor_parallel

    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "trainer.json").read_text())
    saved = (meta["world"], meta["tp"], meta.get("pp", 1), meta.get("ep", 1))  # cp may differ (same shards)
    here = (dist.get_world_size(), backend.tp_size, backend.pp_size, backend.ep_size)
    if saved[1:] != here[1:] or (saved[0] != here[0] and not weights_only):
        raise ValueError(f"checkpoint {ckpt_dir} was saved by {saved[0]} ranks at tp={saved[1]} pp={saved[2]} "
                         f"ep={saved[3]}; this run has {dist.get_world_size()} ranks at tp={backend.tp_size} "
                         f"pp={backend.pp_size} ep={backend.ep_size}")
    shards = load_rank_file(ckpt_dir / _slot_file(backend), map_location="cpu", mmap=weights_only)
    live = backend._local_shards()
    if set(shards["model"]) != set(live):  # e.g. saved with train.lora and loaded without, or another rank
        raise ValueError(f"checkpoint {ckpt_dir} holds {len(shards['model'])} trainable tensors, this run trains "
                         f"{len(live)} (train.lora.rank / target_modules / bias must be those of the saving run)")
    with torch.no_grad():
        for name, tensor in shards["model"].items():
            live[name].copy_(tensor)
    if weights_only:
        return
    if backend.ep_size == 1:
        backend.optimizer.load_state_dict(shards["optim"])
    else:  # Partitioned: the dense part from the stage's shared file, the experts' from this EP rank's
        dense = load_rank_file(ckpt_dir / _dense_file(backend), map_location="cpu")["optim"]
        backend.optimizer.load_state_dict({"parts": [dense] + ([] if shards["optim"] is None else [shards["optim"]])})
    backend._ref_shards = pinned(shards["ref"])
    continue_schedule(backend.scheduler, meta["scheduler"])
    backend.step = meta["step"]
    local = load_rank_file(ckpt_dir / f"rank{dist.get_rank()}.pt")
    set_rng_state(local["rng"])
    tensor_parallel.get_cuda_rng_tracker().set_states(local["tracker"])


def _dense_file(backend) -> str:
    """ep > 1: the optimizer state of this stage's (and TP rank's) dense parameters, which every EP rank holds."""
    return f"pp{backend.pp_rank}_tp{backend.tp_rank}_dense_optim.pt"


def _slot_file(backend) -> str:
    expert = f"_ep{backend.ep_rank}" if backend.ep_size > 1 else ""
    return f"pp{backend.pp_rank}_tp{backend.tp_rank}{expert}.pt"
