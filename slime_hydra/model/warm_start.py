"""A model built offline (``model.path`` null): random init, a tokenizer, an SFT warm start on the task; cached.

    path = resolve_model_path(cfg.model, cfg.data, seed)   # model.path, or the cached built checkpoint

When ``model.path`` is set it is used as is. Otherwise (model options with ``model.tokenizer`` set: tiny and small;
config validation refuses a null path for the others) the checkpoint is built once and cached under
``$SLIME_HYDRA_CACHE`` (default ``~/.cache/slime_hydra``), keyed by a hash of everything that shapes it
(architecture, tokenizer, task and levels, a sample of the task's SFT rows, warm-start settings, seed, this module's
version), so a second run starts at once and a task whose problems changed is built again:

1. a random-init HF checkpoint of the model option's architecture (``model/hf.py``) with its tokenizer: the
   character tokenizer (``model.tokenizer=char``, ``model/tiny.py``) or a byte-level BPE tokenizer trained on the
   task's text (``bpe``, ``model/bpe.py``);
2. a supervised warm start on ``model.sft_warm_start_steps`` batches of ``model.sft_batch_size`` prompt + answer
   pairs the task generates (``task.sft_rows``) at the levels the run uses (``data.dataset.sft_levels``): GRPO from
   a random init gets no learning signal on a task where every sampled group is all-wrong (measured when the default
   was designed: 0% held-out accuracy after 1,850 GRPO steps); a short SFT gives the policy a foothold (about a third
   to a half of answers right) that RL then sharpens.

The SFT is plain single-process torch (AdamW at the constant ``model.sft_lr``, loss = mean NLL of the answer tokens
+ EOS), on the GPU when there is one (bf16 autocast, fp32 weights), else on every CPU core (fp32): the tiny model
takes ~60 s on a 2-core CPU. The driver runs it before Ray starts; where CUDA is available, in a child process
(``resolve_model_path``), so the driver holds no CUDA context afterwards. The cache
directory is written under a temporary name and renamed, so an interrupted build leaves nothing half-made.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from slime_hydra.data.config import DataConfig
from slime_hydra.data.dataset import sft_levels
from slime_hydra.data.tasks import get_task
from slime_hydra.model.config import ModelConfig

CACHE_VERSION = 3
"""Bump when the build below changes, so stale caches are rebuilt."""
BPE_TEXT_ROWS = 20_000
"""Prompt + answer pairs a BPE tokenizer learns its merges from (at least; the SFT rows when there are more)."""
PROGRESS_S = 15.0
"""Seconds between the warm start's progress lines."""


WARM_START_THREADS = 2
"""The CPU warm start's torch thread team: fixed, so a model built offline is the same, bitwise, whatever the
machine's load or core count when it is built (the team's size changes the float reductions: the tiny model's 350
SFT steps ended at loss 0.611 with 1 thread and 0.584 with 2, and scored differently before RL). 2: the team the
README's figures were built with on the 2-core machine. Beside a busy core this build runs slower (the team waits
for its thread there, cores.py), once: the model is cached."""


def cache_root() -> Path:
    return Path(os.environ.get("SLIME_HYDRA_CACHE", Path.home() / ".cache" / "slime_hydra"))


def cache_dir(model: ModelConfig, data: DataConfig, seed: int) -> tuple[Path, str]:
    """The built checkpoint's cache directory and the key it is named by (a hash of everything that shapes the
    build; the task's first SFT rows stand for its problems, so a changed task gets a new build)."""
    levels = sft_levels(data)
    task = get_task(data.task)
    sample = task.sft_rows(16, seed=seed) if levels is None else task.sft_rows(16, seed=seed, levels=levels)
    key = json.dumps({"model": asdict(model), "task": data.task, "levels": levels, "chat": data.apply_chat_template,
                      "rows": sample, "seed": seed, "version": CACHE_VERSION}, sort_keys=True)
    return cache_root() / f"{model.name}-{data.task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}", key


def resolve_model_path(model: ModelConfig, data: DataConfig, seed: int, log=print,
                       in_child: Optional[bool] = None) -> Path:
    """``model.path`` when set; else the cached built checkpoint for this model option and data task (built once).

    in_child: build in a child process (``python -m slime_hydra.model.warm_start``), its output passed to ``log`` line
    by line. Default: when CUDA is available, so the driver, which goes on to run the whole job, holds no CUDA
    context (~0.5 GiB of GPU memory that no memory plan counts) and no SFT memory; on a CPU in process, as before."""
    if model.path is not None:
        return Path(model.path)
    if data.task is None:
        raise ValueError(f"model.path is null, so the {model.name} model is built and warm-started on data.task; "
                         "set data.task=addition or model.path=<HF checkpoint dir>")
    levels = sft_levels(data)
    out, key = cache_dir(model, data, seed)
    if (out / "config.json").exists():
        return out
    log(f"building the {model.name} model and its SFT warm start on task {data.task!r} (once; cached at {out})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        if torch.cuda.is_available() if in_child is None else in_child:
            _build_in_child(model, data.task, tmp, seed, data.apply_chat_template, levels, log)
        else:
            build_checkpoint(model, data.task, tmp, seed, data.apply_chat_template, levels, log=log)
        (tmp / "build_key.json").write_text(key)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same build first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_in_child(model: ModelConfig, task_name: str, out_dir: Path, seed: int, chat_template: bool,
                    levels: Optional[list[int]], log) -> None:
    """``build_checkpoint`` in a fresh Python process (``main`` below), its output lines passed to ``log``."""
    spec = json.dumps({"model": asdict(model), "task": task_name, "out_dir": str(out_dir), "seed": seed,
                       "chat_template": chat_template, "levels": levels})
    child = subprocess.Popen([sys.executable, "-m", "slime_hydra.model.warm_start", spec], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in child.stdout:
        lines.append(line.rstrip("\n"))
        log(lines[-1])
    if child.wait() != 0:
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"building the {model.name} model failed in its child process "
                           f"(exit {child.returncode}):\n{tail}")


def main(argv: Optional[list[str]] = None) -> None:
    """The child of ``_build_in_child``: one JSON argument with build_checkpoint's arguments."""
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    build_checkpoint(ModelConfig(**spec["model"]), spec["task"], Path(spec["out_dir"]), spec["seed"],
                     spec["chat_template"], spec["levels"], log=lambda line: print(line, flush=True))


def build_checkpoint(model: ModelConfig, task_name: str, out_dir: Path, seed: int, chat_template: bool = True,
                     levels: Optional[list[int]] = None, log=print) -> Path:
    """Random init (seed) + tokenizer + ``model.sft_warm_start_steps`` SFT steps on the task; saved to out_dir.

    chat_template: format SFT prompts as the rollout will (data.apply_chat_template). levels: the environment's
    levels to draw SFT rows from (null: the task's own choice; addition has none)."""
    from transformers import AutoModelForCausalLM

    from slime_hydra.model.bpe import build_bpe_tokenizer
    from slime_hydra.model.hf import build_random_checkpoint
    from slime_hydra.model.tiny import build_tiny_tokenizer

    if model.tokenizer is None:
        raise ValueError(f"model={model.name} is not built offline (model.tokenizer is null); set model.path")
    steps, batch = model.sft_warm_start_steps, model.sft_batch_size
    task = get_task(task_name)
    n_rows = max(steps * batch, BPE_TEXT_ROWS if model.tokenizer == "bpe" else 0)
    rows = task.sft_rows(n_rows, seed=seed) if levels is None else task.sft_rows(n_rows, seed=seed, levels=levels)
    if model.tokenizer == "bpe":
        tokenizer = build_bpe_tokenizer([text for r in rows for text in (r["prompt"], r["response"])],
                                        model.vocab_size)
    else:
        tokenizer = build_tiny_tokenizer()
    build_random_checkpoint(model, out_dir, seed=seed, tokenizer=tokenizer, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if steps > 0:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(WARM_START_THREADS)
        net = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
        start = time.time()
        loss = sft(net, tokenizer, rows[:steps * batch], steps, seed, chat_template, lr=model.sft_lr, batch=batch,
                   log=log)
        log(f"  SFT warm start: {steps} steps x {batch} examples on {device} in {time.time() - start:.0f} s, "
            f"final loss {loss:.3f}")
        net.to("cpu").save_pretrained(out_dir, safe_serialization=True)
        del net
        if device == "cuda":
            torch.cuda.empty_cache()
    return out_dir


def sft(net, tokenizer, rows: list[dict], steps: int, seed: int, chat_template: bool = True, lr: float = 1e-3,
        batch: int = 64, log=None) -> float:
    """Train net on prompt -> response + EOS (NLL of the response tokens only), ``batch`` rows a step, on the
    device net is on (bf16 autocast on a GPU); return the last step's loss. ``log``: gets a progress line every
    PROGRESS_S seconds (a busy machine once ran the warm start for 17 minutes without a word)."""
    torch.manual_seed(seed)
    device = next(net.parameters()).device
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0, fused=device.type == "cuda" or None)
    net.train()
    loss = torch.tensor(float("nan"))
    start = shown = time.monotonic()
    for step in range(steps):
        ids, mask = _encode(tokenizer, rows[step * batch:(step + 1) * batch], chat_template)
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = net(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if log is not None and time.monotonic() - shown >= PROGRESS_S and step + 1 < steps:
            shown = time.monotonic()
            log(f"  SFT warm start: step {step + 1}/{steps}, loss {float(loss.detach()):.3f}, {shown - start:.0f} s "
                f"(about {(shown - start) * (steps - step - 1) / (step + 1):.0f} s to go)")
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
    prompts = tokenizer([render_prompt(tokenizer, row["prompt"], chat_template) for row in rows],
                        add_special_tokens=False)["input_ids"]
    responses = tokenizer([row["response"] for row in rows], add_special_tokens=False)["input_ids"]
    seqs, masks = [], []
    for p, r in zip(prompts, responses):
        r = r + [tokenizer.eos_token_id]
        seqs.append(p + r)
        masks.append([0.0] * len(p) + [1.0] * len(r))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask


if __name__ == "__main__":
    main()
