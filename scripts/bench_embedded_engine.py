"""Decode throughput of the embedded engine: BATCH concurrent /generate requests of NEW_TOKENS tokens each.

    OMP_NUM_THREADS=1 python scripts/bench_embedded_engine.py            # the tests' tiny Qwen2, CPU
    python scripts/bench_embedded_engine.py --batch 32 --new-tokens 64 --threads 2
    python3 scripts/bench_embedded_engine.py --model qwen2_5_0_5b --device cuda --batch 256 --new-tokens 256 \
        --reference none                                                 # the rollout issue's GPU target

Builds a random-init Qwen2 checkpoint (default: the rollout tests' shape, 2 layers, hidden 64, vocab 64) in a temp
dir, starts the engine as a subprocess (``--max-batch-size`` = batch), runs WARMUP rounds (``--warmup``), then times
REPEATS rounds of BATCH concurrent requests (sampling at temperature 1, ``ignore_eos`` so every request makes exactly
NEW_TOKENS tokens) and prints generated tokens per second of wall time, as seen by the client, and where each round's
time went: the engine's prefill and decode steps (its ``step_times`` counters), the hand-offs between its event loop
and model thread, answering, and the rest (HTTP, scheduling); the garbage collections in the engine and in this client
(whose heap is frozen first, as the engine's is); and when the answers arrived (first / median / last). One client
keeps its connections across rounds, as the rollout's does (``--reconnect``: new ones every round). ``--model NAME``
takes the shape from conf/model/NAME.yaml instead (random init; on CUDA the engine runs in bf16, with CUDA graphs
unless ``--eager``; ``--layers`` takes fewer of its layers). For scale it also times ``model.generate`` on the same
batch in this process (no HTTP, no scheduler; ``--reference none`` skips it).
"""

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

import yaml

from slime_hydra.heap import GcTimes, freeze
from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine


async def server_info(url: str) -> dict:
    async with SGLangClient(url) as client:
        return await client.server_info()


async def one_round(client: SGLangClient, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Seconds from the round's start until each request's answer arrived, in arrival order (the last is the round's
    wall time; the spread between first and last is mostly how far apart the requests were admitted)."""
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    done = []
    start = time.perf_counter()

    async def timed(prompt):
        out = await client.generate(prompt, params)
        done.append(time.perf_counter() - start)
        return out

    outs = await asyncio.gather(*(timed(p) for p in prompts))
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return done


async def rounds(url: str, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int,
                 reconnect: bool) -> list:
    """``warmup`` rounds (they compile the decode layers and capture graphs; a prefill graph is captured the first
    time its row bucket is met, and how the requests split into prefills differs from round to round), then
    ``repeats`` timed ones; returns each timed round's answer times and the change of the engine's counters over it
    (``step_times``: steps, runs, model_s, wait_s, answer_s by kind; ``gc``: collections and their seconds by
    generation, and ``client_s``, this process's collection seconds; CUDA graphs captured). One client keeps its
    connections open across rounds, as the rollout's client does for a whole run; ``reconnect``: a new client (BATCH
    new TCP connections) every round."""
    client = SGLangClient(url, timeout_s=600)
    # This process's heap (torch's objects and more) is frozen, as the engine's is: unfrozen, one collection of its
    # oldest generation stalled a round by 0.2-0.3 s on an H200, a client's pause, not the engine's. ``ours``
    # counts the collections that still run.
    freeze()
    ours = GcTimes()
    ours.start()
    try:
        out = []
        for _ in range(warmup + repeats):
            mine = ours.as_dict()
            before = await client.server_info()
            if reconnect:
                await client.close()
            answers = await one_round(client, prompts, new_tokens)
            after = await client.server_info()
            (was, now) = (before["internal_states"][0], after["internal_states"][0])
            steps = {kind: {k: v - was["step_times"][kind][k] for k, v in times.items()}
                     for kind, times in now["step_times"].items()}
            gc = {k: [a - b for a, b in zip(now["gc"][k], was["gc"][k])] for k in ("collections", "seconds")}
            gc["client_s"] = sum(ours.seconds) - sum(mine["seconds"])
            out.append((answers, steps, gc, after["cuda_graph_captures"] - before["cuda_graph_captures"]))
        return out[warmup:]
    finally:
        ours.stop()
        await client.close()


def where_it_went(answers: list[float], steps: dict, gc: dict, captures: int) -> str:
    """One round's wall time split into the engine's steps, their hand-offs and answering, and the rest (HTTP in and
    out, scheduler loop); and the garbage collections within it (on either thread, so inside any of those parts)."""
    parts = []
    for kind, t in steps.items():
        if t["steps"]:
            parts.append(f"{t['steps']} {kind} in {t['runs']} runs {t['model_s']:.3f}s "
                         f"({1e3 * t['model_s'] / t['steps']:.2f} ms each)")
    handoff = sum(t["wait_s"] - t["model_s"] for t in steps.values())
    answer = sum(t["answer_s"] for t in steps.values())
    rest = answers[-1] - sum(t["wait_s"] + t["answer_s"] for t in steps.values())
    return (f"{answers[-1]:.3f}s = " + " + ".join(parts) + f" + hand-offs {handoff:.3f}s + answering {answer:.3f}s"
            f" + rest {rest:.3f}s; answers at {answers[0]:.2f} / {statistics.median(answers):.2f} / "
            f"{answers[-1]:.2f}s (first / median / last); garbage collections: engine {sum(gc['seconds']):.3f}s "
            f"({gc['collections'][2]} of the oldest generation), client {gc['client_s']:.3f}s; "
            f"{captures} graphs captured")


@torch.no_grad()
def hf_generate_seconds(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, pad_token_id=0)
    return time.perf_counter() - start


ROOT = Path(__file__).resolve().parents[1]


def model_shape(name: str) -> ModelConfig:
    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    return ModelConfig(**{k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__ and k != "path"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 2; with --model: its own)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--model", default=None, help="conf/model/<name>.yaml shape (overrides the three above)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eager", action="store_true", help="CUDA: no CUDA graphs (--disable-cuda-graph)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's --batch-invariant (algo.true_on_policy, deterministic)")
    parser.add_argument("--reference", default="dynamic", choices=["dynamic", "none"],
                        help="also time HF model.generate (dynamic cache) on the same batch")
    parser.add_argument("--reconnect", action="store_true",
                        help="open new connections every round (default: one client keeps them, as a rollout does)")
    parser.add_argument("--threads", type=int, default=None, help="engine torch threads (default: the engine's)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    if args.model:
        shape = model_shape(args.model)
        if args.layers is not None:
            shape = dataclasses.replace(shape, num_layers=args.layers)
    else:
        shape = ModelConfig(num_layers=args.layers or 2, hidden_size=args.hidden, num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=2 * args.hidden, vocab_size=args.vocab, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    model_dir = build_random_checkpoint(shape, work / "model", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape.vocab_size, (args.batch, args.prompt_tokens), generator=g).tolist()

    extra = ["--num-threads", str(args.threads)] if args.threads else []
    extra += ["--disable-cuda-graph"] if args.eager else []
    extra += ["--batch-invariant"] if args.batch_invariant else []
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    engine = start_embedded_engine(str(model_dir), device=args.device, dtype=dtype, max_batch_size=args.batch,
                                   extra_args=extra, log_path=work / "engine.log")
    try:
        threads = asyncio.run(server_info(engine.url))["torch_threads"]
        timed = asyncio.run(rounds(engine.url, prompts, args.new_tokens, args.warmup, args.repeats,
                                     args.reconnect))
        peak = asyncio.run(server_info(engine.url)).get("max_memory_allocated_bytes")
    finally:
        engine.stop()
    tokens = args.batch * args.new_tokens
    times = [answers[-1] for answers, *_ in timed]
    experts = f", {shape.num_experts} experts top-{shape.moe_top_k}" if shape.is_moe else ""
    print(f"model: {shape.family} {shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}"
          f"{experts}, "
          f"{args.device}{' eager' if args.eager else ''}, engine torch threads {threads}")
    print(f"embedded engine, {args.batch} concurrent requests x {args.new_tokens} new tokens "
          f"({args.prompt_tokens}-token prompts): rounds {', '.join(f'{t:.2f}s' for t in times)}")
    print(f"  -> {tokens / statistics.median(times):,.0f} tokens/s (median round), "
          f"{tokens / min(times):,.0f} tokens/s (best round)")
    for i, round_ in enumerate(timed):
        print(f"  round {i + 1}: {where_it_went(*round_)}")
    if peak is not None:
        print(f"  engine peak GPU memory (torch max_memory_allocated): {peak / 2**30:.2f} GiB")
    if args.reference == "dynamic":
        torch.set_num_threads(threads)  # the same thread count as the engine: a like-for-like reference
        hf = hf_generate_seconds(model_dir, prompts, args.new_tokens, args.device)
        print(f"reference: HF model.generate, same batch in-process, same threads: {tokens / hf:,.0f} tokens/s")


if __name__ == "__main__":
    main()
