#!/usr/bin/env python
"""Trainer-vs-engine logprob agreement on one GPU, trainer variants side by side: what the loop's
``train/train_rollout_logprob_abs_diff`` measures, without the loop.

    PYTHONPATH=. python3 scripts/probe_mismatch.py --model-path DIR [--prompts 64] [--samples 8] [--dtype bf16]
        [--engines graphs,eager] [--reference] [--no-train]

Starts an embedded engine on the GPU (CUDA graphs on, the dtype weights are synced in), samples --samples responses
to each of --prompts addition prompts at --temperature (default 1) with their logprobs, then computes the same tokens'
logprobs with train=fsdp's backend (one rank) in each variant, and prints per variant the mean and max
|trainer - engine| over response tokens and the mean |exp(diff) - 1|, for the logprobs pass (eval mode, no grad:
old / reference logprobs) and for the training forward (one train_step at lr 0: the loop's mismatch metric):

    eager            train.compile=false
    compiled         train.compile=true, train.compile_eager_numerics=false (inductor keeps fp32 between fused ops)
    compiled_eager   train.compile=true, train.compile_eager_numerics=true (the default)
    invariant        the batch-invariant forward of algo.true_on_policy (model/invariant.py; against the
                     ``invariant`` engine, the pair the mode runs)

Who is off, and where (issue 42 item 4): ``--engines graphs,eager`` samples once per engine variant (``graphs``: the
engine's default, CUDA graphs and compiled decode; ``eager``: ``--disable-cuda-graph --torch-compile off``), and
``--reference`` also scores each sample's tokens with plain transformers (one full-sequence forward, SDPA) in fp32
(the reference) and in the run's dtype, so each side's error against the fp32 reference is printed beside the
mismatch: a mismatch that equals the two sides' independent errors is the dtype's rounding (decode with a KV cache
vs one forward over the sequence), not a bug of either. ``--no-train`` skips the training forward (a 7B shape's Adam
state would not fit beside the reference on one GPU).
"""

import argparse
import json
import os
import urllib.request

import torch
import torch.distributed as dist

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.data.tasks import get_task
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.model.warm_start import render_prompt
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.train.backend import init_distributed
from slime_hydra.train.batch import collate, response_logprobs
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.objectives import ActorLoss

VARIANTS = {"eager": dict(compile=False), "compiled": dict(compile=True, compile_eager_numerics=False),
            "compiled_eager": dict(compile=True, compile_eager_numerics=True), "invariant": dict(compile=False)}
ENGINES = {"graphs": [], "eager": ["--disable-cuda-graph", "--torch-compile", "off"], "invariant": ["--batch-invariant"],
           "invariant_eager": ["--batch-invariant", "--disable-cuda-graph"]}
"""Embedded engine variants: extra command-line arguments of its server."""


def sample(url: str, prompts: list[list[int]], n: int, max_new_tokens: int, ragged: bool = False,
           temperature: float = 1.0) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, engine logprobs) of n samples per prompt; ragged: request i asks for
    1 + (37 i mod max_new_tokens) tokens, so the engine's decode batch shrinks step by step to one row."""
    count = len(prompts) * n
    params = [{"temperature": temperature, "max_new_tokens": 1 + (37 * i) % max_new_tokens if ragged else max_new_tokens}
              for i in range(count)]
    body = {"input_ids": [p for p in prompts for _ in range(n)], "return_logprob": True, "sampling_params": params}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        outs = json.loads(resp.read())
    return [(p, o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for p, o in zip([p for p in prompts for _ in range(n)], outs)]


def hf_logprobs(model_path: str, batch, dtype: torch.dtype, device: str, chunk: int = 16) -> torch.Tensor:
    """[B, T] logprobs of each sample's response tokens by plain transformers: one forward over the padded sequence
    (SDPA), the logits in fp32 through the trainer's own ``response_logprobs``, ``chunk`` samples at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    out = torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for s in range(0, batch.size, chunk):
            part = batch.select(range(s, min(s + chunk, batch.size)))
            logits = model(input_ids=part.input_ids.to(device), attention_mask=part.attention_mask.to(device)).logits
            logp, _ = response_logprobs(logits.float(), part.to(device))
            out[s:s + part.size, :logp.shape[1]] = logp.cpu()
            del logits
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    diff = (a - b)[mask]
    return {"mean": float(diff.abs().mean()), "max": float(diff.abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--engines", default="graphs", help="comma-separated, of: " + ", ".join(ENGINES))
    parser.add_argument("--reference", action="store_true", help="also plain transformers in fp32 and in --dtype")
    parser.add_argument("--no-train", action="store_true", help="the logprobs pass only, no training forward")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling and trainer temperature")
    parser.add_argument("--ragged", action="store_true",
                        help="responses of 1 to --max-new-tokens tokens: decode batches of every size, down to one")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model_path)
    rows = get_task("addition").rows("train", seed=0)[: args.prompts]
    prompts = [tokenizer(render_prompt(tokenizer, r["prompt"], True), add_special_tokens=False)["input_ids"]
               for r in rows]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test (fp32, compile is slow there)
    os.environ.setdefault("MASTER_PORT", "29611")
    init_distributed(0, 1)
    from slime_hydra.train.fsdp import FSDPBackend

    low = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for engine_name in args.engines.split(","):
        engine = start_embedded_engine(args.model_path, device=device, timeout_s=900,
                                       dtype="bfloat16" if args.dtype == "bf16" else "float32", max_batch_size=512,
                                       extra_args=ENGINES[engine_name])
        try:
            samples = sample(engine.url, prompts, args.samples, args.max_new_tokens, args.ragged, args.temperature)
        finally:
            engine.stop()
        batch = collate([p + r for p, r, _ in samples], [len(r) for _, r, _ in samples],
                        [[1] * len(r) for _, r, _ in samples], pad_id=tokenizer.pad_token_id or 0,
                        extras={"rollout_logprobs": [lp for _, _, lp in samples],
                                "advantages": [[0.0] * len(r) for _, r, _ in samples]})
        mask = batch.loss_mask.bool()
        engine_lp = batch.extras["rollout_logprobs"]
        print(f"engine {engine_name}: {len(samples)} samples, {int(mask.sum())} response tokens, engine and trainer "
              f"in {args.dtype}", flush=True)
        if args.reference:
            ref = hf_logprobs(args.model_path, batch, torch.float32, device)
            plain = hf_logprobs(args.model_path, batch, low, device) if low != torch.float32 else ref
            print(json.dumps({"engine": engine_name, "engine_vs_fp32": gap(engine_lp, ref, mask),
                              "hf_vs_fp32": gap(plain, ref, mask), "engine_vs_hf": gap(engine_lp, plain, mask)}),
                  flush=True)
        for name in args.variants.split(","):
            overrides = VARIANTS[name]
            torch._dynamo.reset()
            backend = FSDPBackend(args.model_path, TrainConfig(dtype=args.dtype, micro_batch_samples=64, lr=1e-12,
                                                               **overrides), total_steps=1,
                                  batch_invariant=name == "invariant")
            logp, _ = backend.logprobs(batch, temperature=args.temperature)
            diff = (logp - engine_lp)[mask]
            row = {"engine": engine_name, "variant": name, "abs_diff_mean": float(diff.abs().mean()),
                   "abs_diff_max": float(diff.abs().max()), "ratio_abs_dev": float((diff.exp() - 1).abs().mean())}
            if args.reference:
                row["trainer_vs_fp32"] = gap(logp, ref, mask)
                row["trainer_vs_hf"] = gap(logp, plain, mask)
            if not args.no_train:
                train = backend.train_step(batch, ActorLoss(AlgoConfig(), args.max_new_tokens), args.temperature)
                row["train_abs_diff_mean"] = train["train_rollout_logprob_abs_diff"]
                row["train_abs_diff_max"] = train["train_rollout_logprob_abs_diff_max"]
            print(json.dumps(row), flush=True)
            del backend
            if device == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
