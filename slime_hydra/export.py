"""The trained policy as a Hugging Face checkpoint, from any checkpoint of a run.

    python -m slime_hydra.export runs/<run>                  # the newest complete checkpoint
    python -m slime_hydra.export runs/<run> --step 120       # checkpoints/step_000120
    python -m slime_hydra.export runs/<run> --out /models/x  # instead of runs/<run>/export/step_<N>

What comes out, in ``<out>/``: ``config.json``, ``model.safetensors`` (the policy's weights, LoRA merged in, in the
dtype of the checkpoint the run started from: ``train/backend.export_dtype``), ``generation_config.json`` and the
tokenizer's files, which load with ``AutoModelForCausalLM.from_pretrained(out)`` and serve with SGLang
(``--model-path out``); with train.lora also ``<out>/adapter/``, a PEFT adapter directory
(``PeftModel.from_pretrained(base, out / "adapter")``, or SGLang's ``--lora-paths``). A run that finishes writes its
final policy this way by itself (``export_at_end``; loop.Session.export).

How: a checkpoint holds each rank's shards in the layout the run trained with, so this starts the run's training
backend on this machine's CPU (gloo), loads the checkpoint's parameters (``TrainBackend.load(weights_only=True)``:
no optimizer state is read) and writes them with ``export_hf`` / ``export_adapter``, the gathers the weight sync
uses; there is no second converter to drift from what the engines were sent. fsdp: one process (torch's DCP reads
any number of shards); megatron: one per (TP rank, PP stage, EP rank) of the run, as its files are per slot.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from slime_hydra.checkpoint import RUN_RECORD, checkpoint_dir, export_dir, find_resume
from slime_hydra.model.hf import copy_tokenizer

def _export_rank(rank: int, world: int, port: int, backend_name: str, model_path: str, train, ckpt: str,
                 out: str) -> None:
    """One rank of the export: the run's backend on CPU, the checkpoint's parameters, then the HF (and adapter)
    export; module-level so torch.multiprocessing can start it by name."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # on the CPU, whatever this machine has (before anything asks CUDA)
    import importlib

    import torch
    import torch.distributed as dist

    from slime_hydra.train.backend import init_distributed
    from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed(rank, world, master_port=port)
    try:
        module, name = TRAIN_BACKEND_KINDS[backend_name].cls.rsplit(".", 1)
        backend = getattr(importlib.import_module(module), name)(model_path, train, total_steps=1, device="cpu")
        backend.load(ckpt, weights_only=True)
        backend.export_hf(out)
        if train.lora.enabled:
            backend.export_adapter(Path(out) / "adapter")
    finally:
        dist.destroy_process_group()


def export_checkpoint(run_dir: str | Path, step: Optional[int] = None, out: Optional[str | Path] = None) -> Path:
    """Write the HF export of the run's checkpoint ``step`` (default: the newest complete one) to ``out`` (default
    ``<run_dir>/export/step_<N>``); returns ``out``. Raises ValueError naming what is missing."""
    import torch.multiprocessing as mp

    from slime_hydra.config import load_run_config
    from slime_hydra.net import free_port
    from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    latest = find_resume("auto", run_dir)  # checkpoints up to the one ``latest`` names are complete
    ckpt = latest if step is None else checkpoint_dir(run_dir, step)
    if latest is None or ckpt is None or ckpt.name > latest.name or not (ckpt / "loop.json").is_file():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() \
            else []
        raise ValueError(f"{run_dir}: no complete checkpoint{'' if step is None else f' at step {step}'} (here: "
                         f"{', '.join(have) or 'none'}; latest: {latest.name if latest else 'none'})")
    step = json.loads((ckpt / "loop.json").read_text())["step"]
    model_path = run_model_path(run_dir, cfg)
    out = Path(out) if out is not None else export_dir(run_dir, step)
    out.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    world = TRAIN_BACKEND_KINDS[t.backend].export_processes(t.tp, t.pp, t.ep)
    train = replace(t, num_gpus=world, cp=1, compile=False, cuda_graphs=False, gradient_checkpointing=False)
    # forkserver: ranks start from a fresh server process (no threads, no device), or, in a process that already
    # runs one with the backends imported (the tests'), at once
    mp.start_processes(_export_rank, args=(world, free_port(), t.backend, str(model_path), train,
                                           str(ckpt / "actor"), str(out)), nprocs=world, start_method="forkserver")
    copy_tokenizer(model_path, out)
    return out


def run_model_path(run_dir: Path, cfg) -> Path:
    """The checkpoint the run started from: as its run record names it, else as its config resolves it (a model
    built offline is rebuilt from the cache, or built again)."""
    record = Path(run_dir) / RUN_RECORD
    recorded = json.loads(record.read_text()).get("model_path") if record.is_file() else None
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    from slime_hydra.model.warm_start import resolve_model_path

    return resolve_model_path(cfg.model, cfg.data, cfg.seed)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<run>)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint step_<N> (default: the newest)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: <run_dir>/export/step_<N>)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.step, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"slime_hydra.export: {error}", file=sys.stderr)
        return 2
    print(f"exported: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
