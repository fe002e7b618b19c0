"""LoRA shared by the training backends: PEFT's config, the adapter's names on the wire and on disk, merging.

    W' x = W x + s * B (A x),   s = alpha / rank,   A [rank, in] (Kaiming-uniform), B [out, rank] (zeros)

train=fsdp wraps the HF model with PEFT (``peft_config``); train=megatron adapts megatron-core's parallel linears
to the same function (train/megatron/lora.py). Both name an adapter tensor the way PEFT's saved adapters do
(weight_transport.adapter_key: ``base_model.model.<HF module>.lora_A.weight``), so the weight sync, the engines and
``write_adapter``'s PEFT directory share one spelling, and a PEFT directory loads into transformers + peft, SGLang's
``/load_lora_adapter`` or our embedded engine alike. Merged weights (``merge``) are W + s * B A computed in fp32
and rounded once to W's dtype.
"""

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from slime_hydra.train.config import LoraConfig
from slime_hydra.weight_transport import ADAPTER_PREFIX, adapter_key

INIT_SEED = 0
"""Seed of A's random init (``seeded_init``): the same adapter on every rank and in every run, as the base weights
are (torch seeds each process at random)."""
PEFT_ADAPTER = "default"
"""The name PEFT gives the one adapter of a model (its state-dict keys read ``lora_A.default.weight``)."""


def peft_config(lora: LoraConfig):
    """train.lora as PEFT's ``LoraConfig`` (a causal LM: the LM head and embeddings stay frozen). peft is imported
    here, not with the module: it imports a dozen transformers model classes (~5 s of CPU), which processes that
    only name adapter tensors or merge them (the driver, megatron ranks) never need."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), bias=lora.bias, task_type="CAUSAL_LM")


@contextmanager
def seeded_init():
    """Draw the adapters' init from ``INIT_SEED``; the process's RNG streams are left as they were."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        yield


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A in fp32, in W's dtype and device."""
    delta = b.to(device=weight.device, dtype=torch.float32) @ a.to(device=weight.device, dtype=torch.float32)
    return (weight.float() + scale * delta).to(weight.dtype)


def merged_weights(named: Iterator[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT model's state dict (full tensors, in state-dict order) as the HF model's, each adapted linear's weight
    merged: ``<m>.base_layer.weight``, ``<m>.lora_A.default.weight`` and ``<m>.lora_B.default.weight`` become
    ``<m>.weight`` = merge(W, A, B, scale) once all three have been seen (they are adjacent in PEFT's order, so at
    most one module is held); every other tensor passes through under its HF name."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        name = name.removeprefix(ADAPTER_PREFIX)
        for part, leaf in ((".base_layer.", "W"), (f".lora_A.{PEFT_ADAPTER}.", "A"), (f".lora_B.{PEFT_ADAPTER}.", "B")):
            if part in name:
                module, rest = name.split(part)
                break
        else:
            yield name, tensor
            continue
        if leaf == "W" and rest != "weight":  # the adapted layer's bias
            yield f"{module}.{rest}", tensor
            continue
        parts = held.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            yield f"{module}.weight", merge(parts["W"], parts["A"], parts["B"], scale)
            del held[module]
    if held:
        raise ValueError(f"adapted modules without their base weight or adapter: {sorted(held)[:4]}")


def peft_adapter_weights(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The A and B matrices of a PEFT model's state dict under their saved-adapter keys (``adapter_key``)."""
    for name, tensor in named:
        for which in "AB":
            part = f".lora_{which}.{PEFT_ADAPTER}.weight"
            if name.endswith(part):
                yield adapter_key(name.removeprefix(ADAPTER_PREFIX)[:-len(part)], which), tensor


def write_adapter(out_dir: str | Path, lora: LoraConfig, named: Iterator[tuple[str, torch.Tensor]]) -> int:
    """A PEFT adapter directory: ``adapter_config.json`` (``adapter_config``) and ``adapter_model.safetensors``
    holding the ``named`` adapter tensors (``adapter_key`` names), as ``PeftModel.save_pretrained`` writes one.
    Returns the bytes of the tensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in named}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(lora), indent=2, sort_keys=True))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_config(lora: LoraConfig) -> dict:
    """PEFT's adapter config as a JSON-able dict: ``adapter_config.json``'s content, and what an engine needs to
    apply adapters at run time (``--lora-config``)."""
    return json.loads(json.dumps(peft_config(lora).to_dict(), default=list))
