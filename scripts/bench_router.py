"""Router overhead: embedded-engine generation throughput called directly vs through sglang-router, same concurrency.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_router.py         # model=tiny shape, CPU
    python scripts/bench_router.py --concurrency 1,32 --new-tokens 64 --rounds 5

Builds a random-init checkpoint of the ``model=tiny`` architecture (4 layers, hidden 128, vocab 128: the embedded
default's model) in a temp dir, starts one embedded engine and one sglang-router with that engine registered, warms
both paths up, then for each concurrency C runs ROUNDS pairs of rounds, alternating direct and routed (so a change
in the machine's load hits both alike). A round is C concurrent /generate requests of NEW_TOKENS tokens each
(temperature 1, ``ignore_eos``: every request makes exactly NEW_TOKENS tokens). Prints generated tokens per second
of wall time (median round) for each path, routed / direct, and the overhead 1 - routed / direct.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime_hydra.config import compose, to_config
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.router import Router


async def one_round(client: SGLangClient, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for every prompt's /generate, sent at once."""
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return elapsed


async def compare(engine_url: str, router_url: str, prompts: list[list[int]], new_tokens: int,
                  rounds: int) -> tuple[list[float], list[float]]:
    """(direct round seconds, routed round seconds), ROUNDS each, interleaved after one warm-up of each."""
    async with SGLangClient(engine_url) as direct, SGLangClient(router_url) as routed:
        await one_round(direct, prompts, 8)
        await one_round(routed, prompts, 8)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(rounds):
            times[0].append(await one_round(direct, prompts, new_tokens))
            times[1].append(await one_round(routed, prompts, new_tokens))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,32", help="comma-separated concurrent requests per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--policy", default="round_robin", help="router policy")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    work = Path(tempfile.mkdtemp(prefix="bench_router_"))
    shape = to_config(compose(["model=tiny"])).model
    model_dir = build_random_checkpoint(shape, work / "model", seed=0)
    g = torch.Generator().manual_seed(0)
    engine = start_embedded_engine(str(model_dir), max_batch_size=max(levels), log_path=work / "engine.log")
    router = Router(policy=args.policy, log_path=work / "router.log")
    try:
        router.start()
        router.add_worker(engine.url)
        router.wait_ready(1, 60.0)
        print(f"model: tiny ({shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}), "
              f"random init, CPU; {args.new_tokens} new tokens a request, {args.prompt_tokens}-token prompts, "
              f"median of {args.rounds} interleaved rounds")
        for c in levels:
            prompts = torch.randint(0, shape.vocab_size, (c, args.prompt_tokens), generator=g).tolist()
            direct, routed = asyncio.run(compare(engine.url, router.url, prompts, args.new_tokens, args.rounds))
            tokens = c * args.new_tokens
            d, r = tokens / statistics.median(direct), tokens / statistics.median(routed)
            print(f"concurrency {c:>3}: direct {d:,.0f} tok/s, through the router {r:,.0f} tok/s, "
                  f"routed/direct {r / d:.3f} (overhead {100 * (1 - r / d):+.1f}%)")
    finally:
        router.stop()
        engine.stop()


if __name__ == "__main__":
    main()
