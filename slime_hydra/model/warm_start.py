"""The embedded default's model: a tiny checkpoint built offline, warm-started by SFT on the task, cached.

    path = resolve_model_path(cfg.model, cfg.data, seed)   # model.path, or the cached tiny checkpoint

When ``model.path`` is set it is used as is. Otherwise (model=tiny only: config validation refuses a null path for
any other model) the checkpoint is built once and cached under ``$SLIME_HYDRA_CACHE`` (default
``~/.cache/slime_hydra``), keyed by a hash of everything that shapes it (architecture, task, warm-start settings,
seed, this module's version), so a second run starts at once:

1. a random-init HF checkpoint of the model option's architecture (``model/hf.py``) with the character tokenizer
   (``model/tiny.py``);
2. a supervised warm start on ``model.sft_warm_start_steps`` batches of prompt + answer pairs the task generates
   (``task.sft_rows``): GRPO from a random init gets no learning signal on a task where every sampled group is
   all-wrong (measured when the default was designed: 0% held-out accuracy after 1,850 GRPO steps); a short SFT gives the policy a foothold (about a third
   of answers right) that RL then sharpens.

The SFT is plain single-process torch (AdamW, loss = mean NLL of the answer tokens + EOS); it takes ~30-60 s on a
2-core CPU. The cache directory is written under a temporary name and renamed, so an interrupted build leaves
nothing half-made.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
import torch

from slime_hydra.data.config import DataConfig
from slime_hydra.model.config import ModelConfig

CACHE_VERSION = 2
"""Bump when the build below changes, so stale caches are rebuilt."""
SFT_BATCH = 64
"""Prompt + answer pairs per SFT step."""
SFT_LR = 1e-3
"""AdamW learning rate of the warm start (constant)."""


def cache_root() -> Path:
    return Path(os.environ.get("SLIME_HYDRA_CACHE", Path.home() / ".cache" / "slime_hydra"))


def resolve_model_path(model: ModelConfig, data: DataConfig, seed: int, log=print) -> Path:
    """``model.path`` when set; else the cached tiny checkpoint for this model option and data task (built once)."""
    if model.path is not None:
        return Path(model.path)
    if data.task is None:
        raise ValueError("model.path is null, so the tiny model is built and warm-started on data.task; "
                         "set data.task=addition or model.path=<HF checkpoint dir>")
    key = json.dumps({"model": asdict(model), "task": data.task, "chat": data.apply_chat_template, "seed": seed,
                      "version": CACHE_VERSION}, sort_keys=True)
    out = cache_root() / f"{model.name}-{data.task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    log(f"building the {model.name} model and its SFT warm start on task {data.task!r} (once; cached at {out})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        build_tiny_checkpoint(model, data.task, tmp, seed, data.apply_chat_template, log=log)
        (tmp / "build_key.json").write_text(key)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same build first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny_checkpoint(model: ModelConfig, task_name: str, out_dir: Path, seed: int, chat_template: bool = True,
                          log=print) -> Path:
    """Random init (seed) + tokenizer + ``model.sft_warm_start_steps`` SFT steps on the task; saved to out_dir.

    chat_template: format SFT prompts as the rollout will (data.apply_chat_template)."""
    from transformers import AutoModelForCausalLM

    from slime_hydra.data.tasks import get_task
    from slime_hydra.model.hf import build_random_checkpoint
    from slime_hydra.model.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_random_checkpoint(model, out_dir, seed=seed, tokenizer=tokenizer, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    steps = model.sft_warm_start_steps
    if steps > 0:
        torch.set_num_threads(os.cpu_count() or 1)  # nothing else runs yet: use every core
        net = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        rows = get_task(task_name).sft_rows(steps * SFT_BATCH, seed=seed)
        start = time.time()
        loss = sft(net, tokenizer, rows, steps, seed, chat_template)
        log(f"  SFT warm start: {steps} steps x {SFT_BATCH} examples in {time.time() - start:.0f} s, "
            f"final loss {loss:.3f}")
        net.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def sft(net, tokenizer, rows: list[dict], steps: int, seed: int, chat_template: bool = True,
        lr: float = SFT_LR) -> float:
    """Train net on prompt -> response + EOS (NLL of the response tokens only); return the last step's loss."""
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    net.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        chunk = rows[step * SFT_BATCH:(step + 1) * SFT_BATCH]
        ids, mask = _encode(tokenizer, chunk, chat_template)
        logits = net(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    net.eval()
    return float(loss.detach())


def render_prompt(tokenizer, prompt: str, chat_template: bool) -> str:
    """The prompt text the model sees: as a ChatML user turn with the generation prompt, or raw."""
    if not chat_template:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def _encode(tokenizer, rows: list[dict], chat_template: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, L] ids of prompt + response + EOS, and the mask of the response + EOS."""
    seqs, masks = [], []
    for row in rows:
        prompt = render_prompt(tokenizer, row["prompt"], chat_template)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + r)
        masks.append([0.0] * len(p) + [1.0] * len(r))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask
