#!/usr/bin/env python
"""Trainer-vs-engine logprob gap on a MoE model with and without routing replay (``algo.routing_replay``), both
backends, one GPU: what ``train/train_rollout_logprob_abs_diff`` measures in the loop, without the loop.

    PYTHONPATH=. python3 scripts/probe_routing_replay.py --model qwen3_30b_a3b --layers 4 [--prompts 32]
        [--samples 8] [--max-new-tokens 128] [--backends fsdp,megatron] [--out result.json]

Builds a random-init checkpoint of the model's shape with --layers decoder layers (bf16), starts an embedded engine
on the GPU in bf16 with CUDA graphs and ``--enable-return-routed-experts``, samples --samples responses to each of
--prompts random prompts (32 tokens) at temperature 1 with their logprobs and routed experts, then computes the same
tokens' logprobs with each backend (one rank, bf16, the logprobs pass: old / reference logprobs) routing anew and
replaying the engine's experts. Prints per backend and mode the mean, p99 and max |trainer - engine| over response
tokens and the share of tokens off by more than 0.1 nat; and, for fsdp routing anew, how many (position, MoE layer)
choices of the trainer's routers differ from the engine's (as sets of top-k experts).
"""

import argparse
import asyncio
import json
import os
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from bench_train import model_config
from slime_hydra import routed_experts
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.train.backend import init_distributed
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.routing_replay import moe_routers


async def _sample(url: str, prompts: list[list[int]], n: int, max_new_tokens: int) -> list[dict]:
    async with SGLangClient(url, timeout_s=1200) as client:
        return await asyncio.gather(*(client.generate(p, {"temperature": 1.0, "max_new_tokens": max_new_tokens,
                                                           "ignore_eos": True, "sampling_seed": 1000 * i + k},
                                                      return_logprob=True)
                                      for i, p in enumerate(prompts) for k in range(n)))


def _own_choices(backend, batch, layers: int, top_k: int) -> torch.Tensor:
    """[B, L, layers, top_k] the trainer's routers' own choice (fsdp, routing anew), by hooks."""
    b, length = batch.input_ids.shape
    out = torch.full((b, length, layers, top_k), routed_experts.NO_EXPERT, dtype=torch.int16)
    rows = []

    def keep(layer, module, args, output):
        rows.append((layer, output[2].to("cpu", torch.int16)))

    hooks = [r.register_forward_hook(partial(keep, i)) for i, r in moe_routers(backend.hf.model.layers).items()]
    mb = backend.train_cfg.micro_batch_samples
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # the hooks would recompile every layer
        for start in range(0, b, mb):
            sub = batch.select(range(start, min(start + mb, b)))
            rows.clear()
            backend.model(input_ids=sub.input_ids.to(backend.device), attention_mask=sub.attention_mask.to(backend.device),
                          use_cache=False)
            width = sub.input_ids.shape[1]
            for layer, idx in rows:
                out[start:start + sub.size, :width, layer] = idx.view(sub.size, width, top_k)
    for h in hooks:
        h.remove()
    return out


def _gap(logp: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict:
    diff = (logp - engine)[mask].abs().float()
    return {"mean": float(diff.mean()), "p99": float(diff.quantile(0.99)), "max": float(diff.max()),
            "over_0.1": float((diff > 0.1).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--backends", default="fsdp,megatron")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = parser.parse_args()
    cfg = model_config(args.model, args.layers)
    path = build_random_checkpoint(cfg, Path(tempfile.mkdtemp(prefix="routing_replay_")), seed=0,
                                   dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (32,), generator=g).tolist() for _ in range(args.prompts)]
    gpu = torch.cuda.is_available()  # CPU: a smoke test in fp32
    engine = start_embedded_engine(str(path), device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                                   max_batch_size=512,
                                   extra_args=["--enable-return-routed-experts"], timeout_s=600)
    try:
        answers = asyncio.run(_sample(engine.url, prompts, args.samples, args.max_new_tokens))
    finally:
        engine.stop()
    starts = [p for p in prompts for _ in range(args.samples)]
    batch = collate([p + a["output_ids"] for p, a in zip(starts, answers)], [len(a["output_ids"]) for a in answers],
                    [[1] * len(a["output_ids"]) for a in answers], pad_id=0,
                    extras={"rollout": [[x[0] for x in a["meta_info"]["output_token_logprobs"]] for a in answers]},
                    routed_experts=[routed_experts.decode(a["meta_info"]["routed_experts"], cfg.num_layers,
                                                          cfg.moe_top_k) for a in answers])
    engine_logp, mask, replay = batch.extras.pop("rollout"), batch.loss_mask.bool(), batch.routed_experts
    result = {"model": args.model, "layers": args.layers, "samples": batch.size, "response_tokens": int(mask.sum()),
              "dtype": "bf16" if gpu else "fp32", "device": torch.cuda.get_device_name() if gpu else "cpu"}
    print(json.dumps(result), flush=True)
    os.environ.setdefault("MASTER_PORT", "29613")
    init_distributed(0, 1)
    for name in args.backends.split(","):
        if name == "fsdp":
            from slime_hydra.train.fsdp import FSDPBackend as Backend
        else:
            from slime_hydra.train.megatron.backend import MegatronBackend as Backend
        torch._dynamo.reset()
        backend = Backend(str(path), TrainConfig(dtype="bf16" if gpu else "fp32", micro_batch_samples=16, lr=1e-12), total_steps=1)
        batch.routed_experts = None
        plain = backend.logprobs(batch)[0]
        batch.routed_experts = replay
        replayed = backend.logprobs(batch)[0]
        row = {"backend": name, "anew": _gap(plain, engine_logp, mask), "replayed": _gap(replayed, engine_logp, mask)}
        if name == "fsdp":
            own = _own_choices(backend, batch, cfg.num_layers, cfg.moe_top_k).sort(-1).values
            theirs = replay.sort(-1).values
            reported = (theirs != routed_experts.NO_EXPERT).all(-1)
            sparse = reported.any(dim=(0, 1))  # the MoE layers
            flips = ((own != theirs).any(-1) & reported)[..., sparse]
            row["routing_flips"] = {"choices": int(reported[..., sparse].sum()), "differ": int(flips.sum()),
                                    "rows_with_a_flip": int(flips.any(-1).any(-1).sum())}
        result[name] = row
        print(json.dumps(row), flush=True)
        del backend
        if gpu:
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
