"""Where the embedded engine's decode step spends its time: the ModelRunner driven in-process (no HTTP, no scheduler).

    python3 scripts/profile_engine_step.py --model qwen2_5_0_5b --batch 256 --new-tokens 256   # GPU
    OMP_NUM_THREADS=1 python scripts/profile_engine_step.py --new-tokens 32                     # CPU, tiny model

Admits BATCH requests (16-token random prompts, temperature 1, ignore_eos) in one prefill, then runs decode steps
(``ModelRunner.step``; each launches its step and then takes in the previous one) and prints the step's wall time,
the host time to launch the forward (CUDA graph replay or eager call) and the forward's GPU time (CUDA events), and
the time of a prefill of BATCH/2 prompts. Then ``torch.profiler`` traces of PROFILE steps and of one such prefill
print the top ops by GPU time (and the prefill's by host time).
Prints milliseconds per step (median of the measured steps) and the tokens/s that the step time allows.
"""

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.rollout.engines.embedded import runner as runner_module
from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def shape_of(args) -> ModelConfig:
    import yaml

    if args.model is None:
        return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                           vocab_size=64, max_position_embeddings=4096, tie_word_embeddings=False)
    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{args.model}.yaml").read_text())
    shape = ModelConfig(**{k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__ and k != "path"})
    return dataclasses.replace(shape, num_layers=args.layers) if args.layers else shape


class Timed:
    """Wraps the runner's decode forward to time it: host time to launch it, and its GPU time (CUDA events)."""

    def __init__(self, runner, cuda: bool):
        self.cuda = cuda
        self.launch_s, self.gpu_ms, self._events = [], [], []
        owner, name = (runner.graphs, "run") if runner.graphs is not None else (runner, "_decode_forward")
        self._forward = getattr(owner, name)
        setattr(owner, name, self.forward)

    def forward(self, n, window):
        start = time.perf_counter()
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        out = self._forward(n, window)
        if self.cuda:
            end.record()
            self._events.append((begin, end))
        self.launch_s.append(time.perf_counter() - start)
        return out

    def gpu_times(self) -> list[float]:
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) for begin, end in self._events]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="conf/model/<name>.yaml shape (default: the tests' tiny Qwen2)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--torch-compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--profile", type=int, default=8, help="decode steps under torch.profiler (0: none), taken "
                        "halfway through a batch's tokens")
    parser.add_argument("--trace", default=None, help="write the profiled decode steps' Chrome trace to this file")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = shape_of(args)
    model_dir = build_random_checkpoint(shape, Path(tempfile.mkdtemp(prefix="profile_engine_")) / "model", seed=0)
    runner = runner_module.ModelRunner(str(model_dir), device, "bfloat16" if cuda else "float32", args.batch, None,
                                       None, "0", cuda_graph=not args.eager,
                                       torch_compile={"auto": None, "on": True, "off": False}[args.torch_compile])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape.vocab_size, (args.batch, 16), generator=g).tolist()
    params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}

    def requests():
        return [Request(f"r{i}", p, SamplingParams.from_dict(params), True, -1, 0, False, None)
                for i, p in enumerate(prompts)]

    for _ in range(2):  # the first round captures the graphs
        runner.step(requests())
        while runner.running:
            runner.step([])
    prefills = []
    for _ in range(3):  # the HTTP bench's rounds arrive in about two halves
        start = time.perf_counter()
        runner.step(requests()[:args.batch // 2])
        if cuda:
            torch.cuda.synchronize()
        prefills.append(time.perf_counter() - start)
        runner.clear_batch()
    timed = Timed(runner, cuda)
    runner.step(requests())
    steps = []
    while runner.running:
        start = time.perf_counter()
        runner.step([])
        steps.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
    step_ms = statistics.median(steps) * 1e3
    print(f"model {shape.family} {shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}; "
          f"{device}{' eager' if args.eager else ''}, compiled {runner.compiled}; batch {args.batch} x "
          f"{args.new_tokens} new tokens")
    print(f"decode step (median of {len(steps)}): {step_ms:.3f} ms -> {args.batch / step_ms * 1e3:,.0f} tokens/s "
          f"(mean {statistics.mean(steps) * 1e3:.3f} ms, min {min(steps) * 1e3:.3f} ms)")
    print(f"  forward launch {statistics.median(timed.launch_s) * 1e3:.3f} ms (host)")
    if cuda:
        print(f"  forward GPU time (CUDA events) {statistics.median(timed.gpu_times()):.3f} ms")
    print(f"prefill of {args.batch // 2} prompts: {', '.join(f'{t * 1e3:.1f}' for t in prefills)} ms")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        runner.step(requests())
        for _ in range(args.new_tokens // 2):
            runner.step([])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.profile):
                runner.step([])
            if cuda:
                torch.cuda.synchronize()
        if args.trace:
            prof.export_chrome_trace(args.trace)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(f"top ops over {args.profile} decode steps (by {key}):")
        print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))

        runner.clear_batch()
        with profile(activities=activities) as prof:
            runner.step(requests()[:args.batch // 2])
            if cuda:
                torch.cuda.synchronize()
        runner.clear_batch()
        print(f"top ops of a prefill of {args.batch // 2} prompts (by cpu_time_total, then {key}):")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    asyncio.run(main())
