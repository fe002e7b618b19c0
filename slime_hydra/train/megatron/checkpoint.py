"""train=megatron's resumable checkpoints (MegatronBackend.save / load).

Per (PP stage, TP rank), model and optimizer shards (written by the slot's rank with DP and CP rank 0: CP and DP
peers hold identical shards), scheduler and step, and every rank's RNG state; resume needs the same world size, tp
and pp (cp and dp may be traded). To change tp or pp, export_hf and start a new run from the export (optimizer state
is not carried).
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from slime_hydra.train.backend import load_rank_file, rng_state, set_rng_state
from slime_hydra.train.reference import host_copy, pinned


def save(backend, ckpt_dir: str | Path) -> None:
    """Resumable checkpoint of ``backend`` (a MegatronBackend): this (PP stage, TP rank) slot's parameters, optimizer
    and reference shards; scheduler, step; every rank's RNG. Collective."""
    from megatron.core import tensor_parallel

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    if backend.zero:  # every peer's share of the Adam state, gathered on the peer that writes (collective)
        backend.optimizer.consolidate_state_dict(to=0)
    if backend.dp_rank == 0 and backend.cp_rank == 0:  # CP and DP peers hold the same shards
        torch.save({"model": host_copy(backend._local_shards()), "optim": backend.optimizer.state_dict(),
                    "ref": backend._ref_shards}, ckpt_dir / _slot_file(backend))
    torch.save({"rng": rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
               ckpt_dir / f"rank{rank}.pt")
    if rank == 0:
        (ckpt_dir / "trainer.json").write_text(json.dumps(
            {"step": backend.step, "scheduler": backend.scheduler.state_dict(), "world": dist.get_world_size(),
             "tp": backend.tp_size, "pp": backend.pp_size, "cp": backend.cp_size}))
    dist.barrier()


def load(backend, ckpt_dir: str | Path) -> None:
    """Resume from ``save``'s checkpoint: parameters, optimizer, reference shards, scheduler, step, RNG."""
    from megatron.core import tensor_parallel

    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "trainer.json").read_text())
    saved = (meta["world"], meta["tp"], meta.get("pp", 1))  # cp may differ: CP and DP peers hold the same shards
    if saved != (dist.get_world_size(), backend.tp_size, backend.pp_size):
        raise ValueError(f"checkpoint {ckpt_dir} was saved by {saved[0]} ranks at tp={saved[1]} pp={saved[2]}; "
                         f"this run has {dist.get_world_size()} ranks at tp={backend.tp_size} pp={backend.pp_size}")
    shards = load_rank_file(ckpt_dir / _slot_file(backend), map_location="cpu")
    live = backend._local_shards()
    with torch.no_grad():
        for name, tensor in shards["model"].items():
            live[name].copy_(tensor)
    backend.optimizer.load_state_dict(shards["optim"])
    backend._ref_shards = pinned(shards["ref"])
    backend.scheduler.load_state_dict(meta["scheduler"])
    backend.step = meta["step"]
    local = load_rank_file(ckpt_dir / f"rank{dist.get_rank()}.pt")
    set_rng_state(local["rng"])
    tensor_parallel.get_cuda_rng_tracker().set_states(local["tracker"])


def _slot_file(backend) -> str:
    return f"pp{backend.pp_rank}_tp{backend.tp_rank}.pt"
