"""LoRA shared by the training backends: PEFT's config, the adapter's names on the wire and on disk, merging.

    W' x = W x + s * B (A x),   s = alpha / rank,   A [rank, in] (Kaiming-uniform), B [out, rank] (zeros)

train=fsdp wraps the HF model with PEFT (``peft_config``); train=megatron adapts megatron-core's parallel linears
to the same function (train/megatron/lora.py). Both name an adapter tensor the way PEFT's saved adapters do
(``adapter_key``: ``base_model.model.<HF module>.lora_A.weight``), so the weight sync, the engines and
``write_adapter``'s PEFT directory share one spelling, and a PEFT directory loads into transformers + peft, SGLang's
``/load_lora_adapter`` or our embedded engine alike. Merged weights (``merge``) are W + s * B A computed in fp32
and rounded once to W's dtype.
"""

import json
from pathlib import Path
from typing import Iterator

import peft
import torch
from safetensors.torch import save_file

from slime_hydra.train.config import LoraConfig

ADAPTER_PREFIX = "base_model.model."
"""PEFT's prefix of every key in a saved adapter (the PeftModel -> LoraModel -> HF model nesting)."""


def peft_config(lora: LoraConfig) -> peft.LoraConfig:
    """train.lora as PEFT's config (a causal LM: the LM head and embeddings stay frozen)."""
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), bias=lora.bias, task_type="CAUSAL_LM")


def adapter_key(module: str, which: str) -> str:
    """The saved-adapter key of ``module``'s (HF dotted path) ``which`` ("A" or "B") matrix."""
    return f"{ADAPTER_PREFIX}{module}.lora_{which}.weight"


def split_adapter_key(key: str) -> tuple[str, str]:
    """Inverse of ``adapter_key``: (HF module path, "A" | "B")."""
    if not key.startswith(ADAPTER_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
        raise ValueError(f"'{key}' is not a LoRA adapter key ({ADAPTER_PREFIX}<module>.lora_A|B.weight)")
    return key[len(ADAPTER_PREFIX):-len(".lora_A.weight")], key[-len("A.weight")]


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A in fp32, in W's dtype and device."""
    delta = b.to(device=weight.device, dtype=torch.float32) @ a.to(device=weight.device, dtype=torch.float32)
    return (weight.float() + scale * delta).to(weight.dtype)


def write_adapter(out_dir: str | Path, lora: LoraConfig, named: Iterator[tuple[str, torch.Tensor]],
                  base_model: str | None = None) -> int:
    """A PEFT adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors`` holding the ``named``
    adapter tensors (``adapter_key`` names), as ``PeftModel.save_pretrained`` writes one. Returns the bytes of the
    tensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in named}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(lora)
    config.base_model_name_or_path = base_model
    (out / "adapter_config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=list))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def engine_adapter_config(lora: LoraConfig) -> dict:
    """What an engine needs to apply adapters at run time: PEFT's adapter config as JSON-able dict."""
    return json.loads(json.dumps(peft_config(lora).to_dict(), default=list))
