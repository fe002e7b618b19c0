#!/usr/bin/env python
"""Training-step throughput of a backend: random-init model (shape from conf/model/<name>.yaml), bf16 compute, a
policy-gradient loss over the response tokens, global batch of --samples x --seq-tokens tokens per optimizer step.

    PYTHONPATH=. python3 scripts/bench_train.py --backend megatron --steps 10              # 1 GPU
    PYTHONPATH=. python3 scripts/bench_train.py --backend fsdp --steps 10
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_train.py --backend megatron --steps 10   # TP=2
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_train.py --backend fsdp --steps 10       # DP=2
    PYTHONPATH=. python3 scripts/bench_train.py --backend megatron --model tiny --steps 3  # CPU smoke test (fp32)

Every sample is --seq-tokens long: --prompt-tokens of prompt, the rest response (loss on every response token).
Tokens/s counts all tokens of the global batch (prompt + response) per optimizer step, averaged over the steps
after --warmup; peak memory is torch.cuda.max_memory_allocated, the maximum over ranks. Megatron runs TP over all
ranks (--tp, default: all); FSDP runs DP over all ranks (each gets samples/world rows).
"""

import argparse
import os
import socket
import statistics
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


def model_config(name: str) -> ModelConfig:
    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    fields = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__ and k != "path"}
    return ModelConfig(**fields)


def init_process_group() -> tuple[int, int]:
    """torchrun's rank/world, or a single process; nccl for CUDA tensors and gloo for host tensors."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("megatron", "fsdp"), required=True)
    parser.add_argument("--model", default="qwen2_5_0_5b", help="conf/model/<name>.yaml (shape only)")
    parser.add_argument("--checkpoint-dir", default=None, help="random checkpoint cache (default /tmp/bench_<model>)")
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    parser.add_argument("--samples", type=int, default=8, help="samples per optimizer step (global batch)")
    parser.add_argument("--seq-tokens", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per sample (no loss)")
    parser.add_argument("--micro-batch", type=int, default=None, help="samples per forward (default: all of a rank's)")
    parser.add_argument("--tp", type=int, default=None, help="megatron tensor-parallel size (default: world size)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="train.compile, both backends (auto: on with CUDA); the warmup steps pay the compile")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the measured steps, profile one more step and print the N costliest ops (rank 0)")
    parser.add_argument("--trace", default=None, help="with --profile: write the profiled step's Chrome trace here")
    args = parser.parse_args()

    rank, world = init_process_group()
    cuda = torch.cuda.is_available()
    model = model_config(args.model)
    path = Path(args.checkpoint_dir or f"/tmp/bench_{args.model}")
    if rank == 0 and not (path / "config.json").exists():
        build_random_checkpoint(model, path, seed=0, dtype=torch.bfloat16 if cuda else torch.float32)
    dist.barrier()

    tp = (args.tp or world) if args.backend == "megatron" else 1
    dp = world // tp
    rows = args.samples // dp
    train = TrainConfig(backend=args.backend, num_gpus=world, tp=tp, micro_batch_samples=args.micro_batch or rows,
                        lr=1e-6, dtype="bf16" if cuda else "fp32", gradient_checkpointing=args.gradient_checkpointing,
                        compile={"auto": None, "on": True, "off": False}[args.compile])
    total = args.warmup + args.steps
    if args.backend == "megatron":
        from slime_hydra.train.megatron.backend import MegatronBackend as Backend
    else:
        from slime_hydra.train.fsdp import FSDPBackend as Backend
    backend = Backend(path, train, total_steps=total)

    g = torch.Generator().manual_seed(0)
    response = args.seq_tokens - args.prompt_tokens
    tokens = torch.randint(0, model.vocab_size, (args.samples, args.seq_tokens), generator=g).tolist()
    advantages = (torch.randint(0, 2, (args.samples,), generator=g) * 2 - 1).float().tolist()
    batch = collate(tokens, [response] * args.samples, [[1] * response] * args.samples, pad_id=0,
                    extras={"advantages": [[a] * response for a in advantages]})
    dp_rank = getattr(backend, "dp_rank", rank)
    mine = batch.select(list(range(dp_rank, args.samples, dp)))

    times = []
    for step in range(total):
        if cuda:
            torch.cuda.synchronize()
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = backend.train_step(mine, pg_loss)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            backend.train_step(mine, pg_loss)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        if rank == 0:
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            events = prof.key_averages()
            print(events.table(sort_by=key, row_limit=args.profile, max_name_column_width=60))
            if cuda:  # GPU busy far below the wall time = host-bound
                spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                               if e.device_type == torch.autograd.DeviceType.CUDA)
                busy, end = 0.0, float("-inf")
                for lo, hi in spans:  # the union of kernel intervals (streams may overlap)
                    busy += max(hi - max(lo, end), 0)
                    end = max(end, hi)
                print(f"profiled step: {wall * 1e3:.1f} ms wall (with the profiler), GPU busy {busy / 1e3:.1f} ms, "
                      f"{len(spans)} kernels and copies")
            if args.trace:
                prof.export_chrome_trace(args.trace)
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                        device="cuda" if cuda else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_s = statistics.mean(times)
        step_tokens = args.samples * args.seq_tokens
        device = torch.cuda.get_device_name() if cuda else "cpu"
        compiled = getattr(backend, "compiled", False)
        print(f"backend={args.backend} model={args.model} device={device} world={world} tp={tp} dp={dp} "
              f"micro_batch={train.micro_batch_samples} tokens/step={step_tokens} dtype={train.dtype} "
              f"compile={compiled} torch={torch.__version__}")
        print(f"step {step_s * 1000:.1f} ms (median {statistics.median(times) * 1000:.1f}, min {min(times) * 1000:.1f}, "
              f"over {len(times)} steps after "
              f"{args.warmup} warmup) | {step_tokens / step_s:,.0f} tokens/s "
              f"({step_tokens / step_s / world:,.0f} per GPU) | peak memory {peak.item():.2f} GiB | "
              f"last pg_loss {float(metrics['pg_loss']):.4f} grad_norm {metrics['grad_norm']:.3f}")
        print("steps (ms):", " ".join(f"{t * 1000:.1f}" for t in times))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
