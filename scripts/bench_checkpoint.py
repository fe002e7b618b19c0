#!/usr/bin/env python
"""What a trainer checkpoint costs the step, written in the foreground or in the background (checkpoint_in_background):
one rank of a backend, a random-init model shaped like conf/model/<name>.yaml (--layers shrinks it), AdamW state
after one step, no reference copy.

    PYTHONPATH=. python3 scripts/bench_checkpoint.py --model qwen2_5_0_5b --layers 2 --repeats 3   # CPU
    PYTHONPATH=. python3 scripts/bench_checkpoint.py --model qwen2_5_0_5b --repeats 3              # one GPU, bf16

Each repeat (order alternating) takes a foreground save, whose whole write the step waits for, and a background
save, for which the step waits only while the state is copied to host memory (``waited_s``); its write's seconds
come from ``save_finished`` (``write_s``). Then one training step taken while a background write runs and one with
none, to show what the writing thread takes from training (on a 2-core CPU it shares the cores). One JSON line per
measurement, then the medians.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def pg_loss(logp, entropy, mb):
    """-A * logp, token mean under the mask."""
    m = mb.loss_mask
    loss = -(logp * mb.extras["advantages"] * m).sum() / m.sum().clamp(min=1)
    return loss, {"pg_loss": loss.detach()}


def build(model: str, layers: int | None, out: Path) -> Path:
    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    fields = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__ and k != "path"}
    if layers:
        fields["num_layers"] = layers
    return build_random_checkpoint(ModelConfig(**fields), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    parser.add_argument("--model", default="qwen2_5_0_5b")
    parser.add_argument("--layers", type=int, default=None, help="num_layers override (smaller model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    path = build(args.model, args.layers, work / "model")
    train = TrainConfig(dtype="bf16" if cuda else "fp32", micro_batch_samples=8)
    if args.backend == "fsdp":
        from slime_hydra.train.fsdp import FSDPBackend as Backend
    else:
        from slime_hydra.train.megatron.backend import MegatronBackend as Backend
    backend = Backend(path, train, total_steps=100)
    g = torch.Generator().manual_seed(0)
    batch = collate([torch.randint(1, 100, (64,), generator=g).tolist() for _ in range(8)], [32] * 8,
                    [[1] * 32] * 8, pad_id=0, extras={"advantages": [[0.5] * 32] * 8})

    def step() -> float:
        start = time.perf_counter()
        backend.train_step(batch, pg_loss)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # the Adam state exists from here on
    params = sum(p.numel() for p in backend.model.parameters())
    rows: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for background in ((False, True) if repeat % 2 == 0 else (True, False)):
            ckpt = work / f"ckpt_{repeat}_{int(background)}"
            ckpt.mkdir()
            start = time.perf_counter()
            backend.save(ckpt, background=background)
            waited = time.perf_counter() - start
            while_writing = step() if background else None
            write = backend.save_finished(wait=True) if background else waited
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            row = {"mode": "background" if background else "foreground", "waited_s": waited, "write_s": write,
                   "gb": size / 1e9, "params": params}
            if background:
                row.update(step_while_writing_s=while_writing, step_alone_s=step())
            print(json.dumps(row), flush=True)
            for key, value in row.items():
                if key.endswith("_s"):
                    rows.setdefault(f"{row['mode']} {key}", []).append(value)
            shutil.rmtree(ckpt)
    for key, values in rows.items():
        print(f"{key}: median {statistics.median(values):.3f} s, min {min(values):.3f} s over {len(values)}")
    dist.destroy_process_group()
    if not args.dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
