"""Checks that read the filesystem: the checkpoint and dataset paths a run will open.

Kept apart from config/rules.py because recipes name shared-storage paths that exist only on the cluster: a dry
run reports these as warnings, a real run (or a submission, from a login node that sees shared storage) refuses.
When ``model.path`` holds a ``config.json``, its architecture must match the chosen model option, since
validation reasoned with the option's numbers.
"""

import json
from pathlib import Path
from typing import Iterator

from slime_hydra.options import Problem
from slime_hydra.config.schema import SlimeConfig

# model option field -> HF config.json keys that may hold it (first present wins)
HF_KEYS = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "ffn_hidden_size": ("intermediate_size",),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_position_embeddings": ("max_position_embeddings",),
    "num_experts": ("num_experts", "n_routed_experts"),
    "moe_top_k": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_experts": ("n_shared_experts",),
    "first_dense_layers": ("first_k_dense_replace",),
    "moe_groups": ("n_group",),
    "moe_group_top_k": ("topk_group",),
    "moe_routed_scaling": ("routed_scaling_factor",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
}


def check_files(cfg: SlimeConfig) -> Iterator[Problem]:
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not path.is_dir():
            yield Problem(("model.path",), f"{path} is not a directory", "point model.path at an HF checkpoint dir")
        elif not (path / "config.json").is_file():
            yield Problem(("model.path",), f"{path} has no config.json", "point model.path at an HF checkpoint dir")
        else:
            yield from _compare_architecture(cfg, json.loads((path / "config.json").read_text()))
    datasets = [("data.path", cfg.data.path)] + [(f"data.eval.{i}.path", e.path) for i, e in enumerate(cfg.data.eval)]
    for key, value in datasets:
        if value is not None and not Path(value).is_file():
            yield Problem((key,), f"{value} does not exist", f"set {key} to an existing .jsonl or .parquet file")


def _compare_architecture(cfg: SlimeConfig, hf: dict) -> Iterator[Problem]:
    hf = {**hf.get("text_config", {}), **hf}
    for field, keys in HF_KEYS.items():
        ours = getattr(cfg.model, field)
        theirs = next((hf[k] for k in keys if k in hf), None)
        if theirs is None or not ours:
            continue
        if ours != theirs:
            yield Problem((f"model.{field}",),
                          f"model={cfg.model.name} says {field}={ours} but {cfg.model.path}/config.json says {theirs}",
                          "choose the model option of this checkpoint (or override the field)")
