"""Tiny random Qwen2 checkpoints and reference computations (plain HF forward passes) for the rollout tests."""

import asyncio
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.manager import RolloutManager

VOCAB = 64
EOS_PROMPT = [5, 9, 13]
"""The prompt whose greedy continuation (under seed 0 weights) reaches the EOS token chosen in build_models."""
EOS_AT = 5
"""EOS is the token greedy decoding of EOS_PROMPT emits at this output index (or earlier, if it appears before)."""


def build_model(out_dir: Path, seed: int, eos_token_id=None) -> Path:
    """2 layers, hidden 64, 4 heads, 2 KV heads, vocab 64, fp32, random init from ``seed``; saved with safetensors."""
    torch.manual_seed(seed)
    config = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=4096,
                         eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def build_models(root: Path) -> tuple[Path, Path, int]:
    """Two checkpoints with different weights (seeds 0 and 1) sharing one EOS id that seed 0 actually emits."""
    probe = load(build_model(root / "probe", seed=0))
    greedy = reference_greedy(probe, EOS_PROMPT, EOS_AT + 1)
    eos = greedy[EOS_AT]
    return build_model(root / "policy_a", 0, eos), build_model(root / "policy_b", 1, eos), eos


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens, each from a full forward pass over everything so far (no cache, no EOS)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` (stops at the checkpoint's EOS, which it includes)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """(response logprobs, prompt logprobs from token 1) under log_softmax(logits / temperature), one forward pass."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    targets = ids[0, 1:]
    per_token = logp[:-1].gather(1, targets[:, None])[:, 0]
    return per_token[len(prompt) - 1:].tolist(), per_token[:len(prompt) - 1].tolist()


def tokens(resp: dict) -> list[int]:
    return resp["output_ids"]


def logprobs(resp: dict) -> list[float]:
    return [item[0] for item in resp["meta_info"]["output_token_logprobs"]]


def mean_abs_diff(a, b) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return float(torch.tensor(a, dtype=torch.float64).sub(torch.tensor(b, dtype=torch.float64)).abs().mean())


def send_weights(master_port: int, model_dir: str, world_size: int = 2, backend: str = "gloo",
                 device: str = "cpu", group_name: str = "weight_update_group") -> None:
    """Trainer stand-in (run in its own process): host the weight-update group as rank 0, broadcast every tensor of
    ``model_dir`` (moved to ``device``) in sorted-name order, then wait for a line on stdin before leaving."""
    from slime_hydra.rollout.engines.embedded.server import read_checkpoint
    from slime_hydra.weight_transport import (
        destroy_weight_update_group, init_weight_update_group, send_named_tensors,
    )

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    named = {name: t.to(device) for name, t in read_checkpoint(model_dir).items()}
    group = init_weight_update_group("127.0.0.1", master_port, rank=0, world_size=world_size,
                                     group_name=group_name, backend=backend, timeout_s=60,
                                     device=device if device.startswith("cuda") else None)
    send_named_tensors(group, [(name, named[name]) for name in sorted(named)])
    print("sent", flush=True)
    sys.stdin.readline()
    destroy_weight_update_group(group)


def manager_config(tmp_path: Path, *overrides: str):
    """The composed config of a rollout-manager test: the tiny model (random init, no SFT), eval off."""
    from slime_hydra.config import compose, to_config

    return to_config(compose(["model.sft_warm_start_steps=0", "rollout.eval_every_steps=0", "data.eval=[]",
                              f"output_dir={tmp_path}", "run_name=r", *overrides]))


class InspectedManager(RolloutManager):
    """The real RolloutManager, plus what the tests read of its engine pool (rollout/engine_pool.py) from outside the
    actor: nothing here changes what it does."""

    async def engine_weight_versions(self) -> list[str]:
        return await self.pool.on_engines("get_weight_version")

    async def check_engines(self) -> list[int]:
        return await self.pool.check()

    async def wait_engines_settled(self, timeout_s: float = 300.0) -> None:
        await self.pool.settled(timeout_s)


def start_manager(cfg, run_dir: Path, num_engines: int = 2, lora: dict | None = None):
    """An InspectedManager actor with ``num_engines`` embedded CPU engines (one torch thread each; serving LoRA adapters
    of the PEFT config ``lora``), started; returns (manager, engine actors, engine urls). Ray must be initialised."""
    import ray

    from slime_hydra.model.warm_start import resolve_model_path
    from slime_hydra.rollout.engines.actor import EngineSpec

    model_path = str(resolve_model_path(cfg.model, cfg.data, cfg.seed))
    spec = EngineSpec(dict(model_path=model_path, log_dir=str(run_dir / "logs"), dtype="float32", max_batch_size=256,
                           torch_threads=1, lora=lora))
    engines = [spec.make(i, 0) for i in range(num_engines)]
    manager = ray.remote(InspectedManager).options(num_cpus=0).remote(cfg, model_path, str(run_dir), engines, spec)
    urls = ray.get(manager.start.remote(), timeout=300)
    return manager, engines, urls


async def engine_info(urls: list[str], api_key: str, lora_path: str | None = None) -> list[dict]:
    """Per engine: tokens generated since start, 12 greedy tokens after [5, 6, 7, 8], and the weight version."""
    async def one(url):
        async with SGLangClient(url, api_key=api_key) as c:
            c.lora_path = lora_path
            info = await c.server_info()
            greedy = await c.generate([5, 6, 7, 8], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
            return {"tokens": info["internal_states"][0]["generated_tokens"], "greedy": greedy["output_ids"],
                    "version": info["weight_version"]}
    return list(await asyncio.gather(*[one(u) for u in urls]))


async def wait_running(url: str, api_key: str, timeout_s: float = 60.0) -> None:
    """Until the engine at ``url`` holds a request."""
    deadline = time.monotonic() + timeout_s
    async with SGLangClient(url, api_key=api_key) as c:
        while (await c.get_load())[0]["num_reqs"] == 0:
            assert time.monotonic() < deadline, f"no request reached {url} within {timeout_s} s"
            await asyncio.sleep(0.01)
