#!/usr/bin/env python
"""Training-step throughput of a backend: random-init model (shape from conf/model/<name>.yaml), bf16 compute, a
policy-gradient loss over the response tokens, global batch of --samples x --seq-tokens tokens per optimizer step.

    PYTHONPATH=. python3 scripts/bench_train.py --backend megatron,fsdp,hf --steps 20      # 1 GPU, interleaved
    PYTHONPATH=. python3 scripts/bench_train.py --backend fsdp --steps 10
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_train.py --backend megatron --steps 10   # TP=2
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_train.py --backend fsdp --steps 10       # DP=2
    PYTHONPATH=. python3 scripts/bench_train.py --backend megatron --model tiny --steps 3  # CPU smoke test (fp32)
    PYTHONPATH=. python3 scripts/bench_train.py --backend fsdp --model qwen3_30b_a3b --layers 4   # MoE, fewer layers
    PYTHONPATH=. python3 scripts/bench_train.py --backend fsdp,fsdp-packed --samples 16 --responses 32:1024 \
        --max-tokens 8192 --steps 10        # ragged responses: padded (length-sorted) against padding-free

Every sample is --seq-tokens long: --prompt-tokens of prompt, the rest response (loss on every response token);
with --responses LO:HI the responses are instead evenly spread from LO to HI tokens (a ragged RL batch).
``fsdp-packed`` / ``megatron-packed`` are the backends with train.pack_sequences (padding-free micro-batches); --max-tokens sets
train.max_tokens_per_gpu (padded: rows x longest row per micro-batch, rows sorted by length; packed: real tokens).
Tokens/s counts all real tokens of the global batch (prompt + response, no padding) per optimizer step, averaged
over the steps after --warmup; MFU is the model FLOPs those tokens take (``flops_per_token`` at each sample's
length) over --peak-tflops per GPU; peak
memory is torch.cuda.max_memory_allocated, the maximum over ranks (one backend per run only).
Megatron runs TP over all ranks (--tp, default: all); FSDP runs DP over all ranks (rows dealt by batch.dp_shares).

Several backends (comma-separated) live in one process and take turns, one step each per round (the order rotates
every round), and the figures include each one's time relative to the first: the GPU machines' speed drifts by the
minute (the same kernels take 65 to 170 ms a step; docs/benchmarks.md), so only steps taken side by side compare.
``hf`` is the reference the targets name: plain transformers training (fp32 weights under bf16 autocast, full
logits, log_softmax, fused AdamW), one rank.
"""

import argparse
import json
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
from slime_hydra.train.batch import collate, dp_shares, predicting_positions
from slime_hydra.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def pg_loss(logp, entropy, mb):
    """-A * logp, token mean under the mask."""
    m = mb.loss_mask
    loss = -(logp * mb.extras["advantages"] * m).sum() / m.sum().clamp(min=1)
    return loss, {"pg_loss": loss.detach()}


def model_config(name: str, layers: int | None = None) -> ModelConfig:
    """The shape of conf/model/<name>.yaml, with ``layers`` decoder layers if given."""
    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    fields = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__ and k != "path"}
    if layers is not None:
        fields["num_layers"] = layers
    return ModelConfig(**fields)


def flops_per_token(m: ModelConfig, seq_tokens: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward): 6 x the matmul parameters one token meets (the
    attention projections, the MLP, for a MoE layer its router and moe_top_k experts only, and the LM head; not the
    embedding lookup) + 6 L (h d) s for causal attention's scores and weighted sum over s tokens (half of the
    12 L (h d) s of a full score matrix)."""
    h, g, d, hidden = m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.hidden_size
    attention = hidden * (h + 2 * g) * d + h * d * hidden
    if m.is_moe:
        mlp = m.moe_top_k * 3 * hidden * m.moe_ffn_hidden_size + hidden * m.num_experts
    else:
        mlp = 3 * hidden * m.ffn_hidden_size
    matmul = m.num_layers * (attention + mlp) + m.vocab_size * hidden
    return 6 * matmul + 6 * m.num_layers * h * d * seq_tokens


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


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams may overlap)."""
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        busy += max(hi - max(lo, end), 0)
        end = max(end, hi)
    return busy


def profile_step(name: str, backend, batch, rows: int, kernels: str | None, trace: str | None, rank: int) -> None:
    """Profile one step; rank 0 prints the ``rows`` costliest ops by GPU time and by host time, the GPU busy time
    (union of kernel intervals: far below the wall time = host-bound) and writes the op table / trace if asked."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        backend.train_step(batch, pg_loss)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if rank != 0:
        return
    print(f"== {name}")
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows,
                       max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="cpu_time_total", row_limit=rows, max_name_column_width=60))
        spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"profiled step: {wall * 1e3:.1f} ms wall (with the profiler), GPU busy {busy_time(spans) / 1e3:.1f} ms, "
              f"{len(spans)} kernels and copies")
    if kernels:
        Path(kernels).write_text(json.dumps(
            [{"name": e.key, "count": e.count, "cuda_us": getattr(e, "self_device_time_total", 0.0),
              "cpu_us": e.self_cpu_time_total} for e in events]))
    if trace:
        prof.export_chrome_trace(trace)


def timeline(backend, batch, steps: int, rank: int) -> None:
    """Profile ``steps`` train steps; print each one's wall time, GPU busy time and its three longest GPU-idle
    gaps, each with the innermost host op that was running at the gap's middle (what the GPU waited for)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for k in range(steps):
            with record_function(f"bench_step_{k}"):
                backend.train_step(batch, pg_loss)
                if cuda:
                    torch.cuda.synchronize()
    if rank != 0:
        return
    events = prof.events()
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for k in range(steps):
        step = next(e for e in host if e.name == f"bench_step_{k}")
        lo, hi = step.time_range.start, step.time_range.end
        mine = [(a, b) for a, b in gpu if lo <= a < hi]
        gaps, end = [], lo
        for a, b in mine:
            if a > end:
                gaps.append((a - end, end))
            end = max(end, b)
        gaps.append((hi - end, end))
        parts = []
        for length, start in sorted(gaps, reverse=True)[:3]:
            middle = start + length / 2
            running = [e for e in host if e.thread == step.thread and e.time_range.start <= middle < e.time_range.end
                       and e is not step]
            inner = min(running, key=lambda e: e.time_range.end - e.time_range.start).name if running else "-"
            parts.append(f"{length / 1e3:.1f} ms in {inner[:50]}")
        print(f"timeline step {k}: wall {(hi - lo) / 1e3:.1f} ms, GPU busy {busy_time(mine) / 1e3:.1f} ms, "
              f"{len(mine)} kernels; longest idle: " + "; ".join(parts))


class PlainHF:
    """The baseline: a transformers model trained the plain way (fp32 parameters, torch.autocast bf16, the full
    [B, L, V] logits through log_softmax, fused AdamW). One rank."""

    def __init__(self, path: Path, train: TrainConfig):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model.to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, fused=self.device.type == "cuda")
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=train.dtype == "bf16")

    def train_step(self, batch, loss_fn) -> dict:
        mb = batch.to(self.device)
        length = mb.input_ids.shape[1]
        with self.autocast:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        per_token = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(2, mb.input_ids[:, 1:, None])[..., 0]
        pos, valid = predicting_positions(mb, length)  # [B, L - 1] -> the response columns [B, T]
        logp = torch.gather(per_token, 1, pos.clamp(max=length - 2)) * valid
        loss, metrics = loss_fn(logp, None, mb)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**metrics, "grad_norm": float(grad_norm)}


def build(name: str, path: Path, train: TrainConfig, total: int):
    if name == "megatron-loop":  # MoE experts as megatron's SequentialMLP loop instead of moe.GroupedExperts
        from unittest import mock

        from megatron.core.transformer.moe.experts import SequentialMLP

        from slime_hydra.train.megatron.backend import MegatronBackend

        with mock.patch("slime_hydra.train.megatron.spec.GroupedExperts", SequentialMLP):
            return MegatronBackend(path, train, total_steps=total)
    if name.startswith("megatron"):
        from slime_hydra.train.megatron.backend import MegatronBackend

        return MegatronBackend(path, train, total_steps=total)
    if name.startswith("fsdp"):
        from slime_hydra.train.fsdp import FSDPBackend

        return FSDPBackend(path, train, total_steps=total, batch_invariant=name.endswith("-invariant"))
    return PlainHF(path, train)


def make_batch(args, model: ModelConfig, seed: int):
    """The global batch: --samples samples of --prompt-tokens prompt tokens and a response each (all --seq-tokens
    long; with --responses LO:HI evenly spread from LO to HI tokens, or with --fresh-lengths drawn uniformly from
    LO..HI by ``seed``), random tokens, advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    if args.responses:
        lo, hi = (int(x) for x in args.responses.split(":"))
        if args.fresh_lengths:
            responses = torch.randint(lo, hi + 1, (args.samples,), generator=g).tolist()
        else:
            responses = [round(lo + (hi - lo) * i / max(args.samples - 1, 1)) for i in range(args.samples)]
    else:
        responses = [args.seq_tokens - args.prompt_tokens] * args.samples
    lengths = [args.prompt_tokens + r for r in responses]
    tokens = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    advantages = (torch.randint(0, 2, (args.samples,), generator=g) * 2 - 1).float().tolist()
    return collate(tokens, responses, [[1] * r for r in responses], pad_id=0,
                   extras={"advantages": [[a] * r for a, r in zip(advantages, responses)]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True,
                        help="megatron, fsdp or hf, or several comma-separated (one process, taking turns); "
                             "megatron-fused / fsdp-fused: with train.compile_eager_numerics=false; megatron-loop: "
                             "MoE experts as megatron's SequentialMLP loop (not grouped matmuls); fsdp-invariant: the "
                             "batch-invariant forward of algo.true_on_policy (never compiled)")
    parser.add_argument("--model", default="qwen2_5_0_5b", help="conf/model/<name>.yaml (shape only)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model option's)")
    parser.add_argument("--peak-tflops", type=float, default=989.4,
                        help="the GPU's dense bf16 peak for MFU (H100 SXM: 989.4 TFLOP/s)")
    parser.add_argument("--checkpoint-dir", default=None, help="random checkpoint cache (default /tmp/bench_<model>)")
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps (per backend)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    parser.add_argument("--samples", type=int, default=8, help="samples per optimizer step (global batch)")
    parser.add_argument("--seq-tokens", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per sample (no loss)")
    parser.add_argument("--responses", default=None, metavar="LO:HI",
                        help="response lengths evenly spread from LO to HI tokens (default: all --seq-tokens long)")
    parser.add_argument("--fresh-lengths", action="store_true",
                        help="with --responses: every step draws new response lengths (uniform in LO..HI), as RL "
                             "batches do; tokens/s is then the mean step's tokens over the mean step time")
    parser.add_argument("--max-tokens", type=int, default=None, help="train.max_tokens_per_gpu (token budget)")
    parser.add_argument("--micro-batch", type=int, default=None, help="samples per forward (default: all of a rank's)")
    parser.add_argument("--tp", type=int, default=None,
                        help="megatron tensor-parallel size (default: world size / --ep)")
    parser.add_argument("--ep", type=int, default=1, help="megatron expert-parallel size (MoE models)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="train.compile, both backends (auto: on with CUDA); the warmup steps pay the compile")
    parser.add_argument("--static-shapes", action="store_true",
                        help="compile one static graph per input shape (dynamo's automatic_dynamic_shapes off, "
                             "recompile limit 64) instead of a dynamic-shape graph after the first new shape")
    parser.add_argument("--cuda-graphs", action="store_true", help="train.cuda_graphs (compiled layers as CUDA graphs)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the measured steps, profile one more step and print the N costliest ops (rank 0)")
    parser.add_argument("--trace", default=None, help="with --profile: write the profiled step's Chrome trace here")
    parser.add_argument("--kernels", default=None,
                        help="with --profile: write every op's count and self CUDA / CPU time (us) here, as JSON")
    parser.add_argument("--timeline", type=int, default=0, metavar="N",
                        help="after the measured steps, profile N more steps: per step the wall time, the GPU busy "
                             "time and the longest GPU-idle gaps with the host op running in each (rank 0)")
    args = parser.parse_args()
    names = args.backend.split(",")
    known = ("megatron", "fsdp", "hf", "megatron-fused", "fsdp-fused", "megatron-loop", "fsdp-packed", "megatron-packed",
             "fsdp-invariant")
    if any(n not in known for n in names) or len(set(names)) < len(names):
        parser.error(f"--backend takes {', '.join(known)}, each at most once; got {args.backend!r}")

    rank, world = init_process_group()
    if args.static_shapes:
        import torch._dynamo as dynamo

        dynamo.config.automatic_dynamic_shapes = False
        from slime_hydra.train.backend import allow_recompiles

        allow_recompiles(64)
    if "hf" in names and world > 1:
        parser.error("--backend hf (the plain transformers baseline) runs on one rank")
    cuda = torch.cuda.is_available()
    model = model_config(args.model, args.layers)
    path = Path(args.checkpoint_dir or f"/tmp/bench_{args.model}{'' if args.layers is None else f'_{args.layers}l'}")
    if rank == 0 and not (path / "config.json").exists():
        build_random_checkpoint(model, path, seed=0, dtype=torch.bfloat16 if cuda else torch.float32)
    dist.barrier()

    total = args.warmup + args.steps
    batches = [make_batch(args, model, seed=step if args.fresh_lengths else 0) for step in range(total)]
    lengths = [batches[step].attention_mask.sum(-1).tolist() for step in range(total)]

    backends, shares, layouts = {}, {}, {}
    for name in names:
        megatron = name.startswith("megatron")
        tp, ep = ((args.tp or world // args.ep), args.ep) if megatron else (1, 1)
        dp = world // tp
        train = TrainConfig(backend="megatron" if megatron else "fsdp", num_gpus=world, tp=tp, ep=ep,
                            micro_batch_samples=args.micro_batch or args.samples // dp, lr=1e-6,
                            max_tokens_per_gpu=args.max_tokens, pack_sequences=name.endswith("-packed"),
                            dtype="bf16" if cuda else "fp32", gradient_checkpointing=args.gradient_checkpointing,
                            compile={"auto": None, "on": True, "off": False}[args.compile],
                            cuda_graphs=args.cuda_graphs, compile_eager_numerics=not name.endswith("-fused"))
        backends[name] = build(name, path, train, total)
        dp_rank = getattr(backends[name], "dp_rank", rank)
        shares[name] = [b.select(dp_shares(b, dp)[dp_rank]) for b in batches]  # token-balanced, as the loop deals
        layouts[name] = (f"world={world} tp={tp} ep={ep} dp={dp} micro_batch={train.micro_batch_samples} "
                         f"compile={getattr(backends[name], 'compiled', False)} cuda_graphs={args.cuda_graphs}")

    times: dict[str, list[float]] = {name: [] for name in names}
    metrics: dict[str, list[dict]] = {name: [] for name in names}
    for step in range(total):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:  # the order rotates: no backend always follows the same one
            if cuda:
                torch.cuda.synchronize()
                if step == args.warmup:
                    torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            metrics[name].append(backends[name].train_step(shares[name][step], pg_loss))
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for name in names:
        if args.profile:
            kernels = args.kernels and (args.kernels if len(names) == 1 else
                                        str(Path(args.kernels).with_stem(f"{Path(args.kernels).stem}_{name}")))
            trace = args.trace and (args.trace if len(names) == 1 else
                                    str(Path(args.trace).with_stem(f"{Path(args.trace).stem}_{name}")))
            profile_step(name, backends[name], shares[name][-1], args.profile, kernels, trace, rank)
        if args.timeline:
            print(f"== {name}")
            timeline(backends[name], shares[name][-1], args.timeline, rank)
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                        device="cuda" if cuda else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        measured = lengths[args.warmup:]
        step_tokens = statistics.mean(sum(n) for n in measured)
        step_flops = statistics.mean(sum(x * flops_per_token(model, x) for x in n) for n in measured)
        device = torch.cuda.get_device_name() if cuda else "cpu"
        span = f"{min(min(n) for n in measured)}..{max(max(n) for n in measured)}"
        print(f"model={args.model} device={device} tokens/step={step_tokens:.0f} (lengths {span}"
              f"{', new each step' if args.fresh_lengths else ''}) dtype={'bf16' if cuda else 'fp32'} "
              f"torch={torch.__version__} rounds={args.steps} after {args.warmup} warmup")
        for name in names:
            t = times[name]
            step_s = statistics.mean(t)
            print(f"backend={name} {layouts[name]}")
            mfu = step_flops / step_s / world / (args.peak_tflops * 1e12)
            print(f"  step {step_s * 1000:.1f} ms (median {statistics.median(t) * 1000:.1f}, min {min(t) * 1000:.1f}) "
                  f"| {step_tokens / step_s:,.0f} tokens/s ({step_tokens / step_s / world:,.0f} per GPU, "
                  f"MFU {mfu:.1%} on the mean) "
                  f"| last pg_loss {float(metrics[name][-1]['pg_loss']):.4f} "
                  f"grad_norm {metrics[name][-1]['grad_norm']:.3f}")
            print("  steps (ms):", " ".join(f"{x * 1000:.1f}" for x in t))
            for key in ("pg_loss", "grad_norm"):  # every step's, warm-up included: layouts compare step by step
                print(f"  {key} by step:", " ".join(f"{float(m[key]):.6f}" for m in metrics[name]))
        if len(names) == 1:
            print(f"peak memory {peak.item():.2f} GiB")
        else:
            print(f"peak memory {peak.item():.2f} GiB (all {len(names)} backends resident)")
            first = names[0]
            for other in names[1:]:  # speed of `first` relative to `other`: > 1 means first is faster
                per_round = [b / a for a, b in zip(times[first], times[other])]
                print(f"speed {first} / {other}: {statistics.mean(times[other]) / statistics.mean(times[first]):.3f} "
                      f"on the means, {statistics.median(per_round):.3f} median of the rounds "
                      f"(min {min(per_round):.3f}, max {max(per_round):.3f}), {first} faster in "
                      f"{sum(r > 1 for r in per_round)}/{len(per_round)} rounds")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
