"""HF transformers configs and random-init checkpoints built from a model option (no hub access needed).

Used for the embedded default (model=tiny), for tests (tiny random models of each family) and for speed
benchmarks on GPU machines (a Qwen2.5-0.5B-shaped model with random weights measures speed, not learning).
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from slime_hydra.model.config import GROUPED_ROUTER_FAMILIES, ModelConfig

if TYPE_CHECKING:  # torch and transformers' model classes are imported where used: a process that only loads a
    import torch   # tokenizer (the driver, the rollout manager) saves ~5 s of CPU of importing them
    from transformers import PretrainedConfig


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, as the class its tokenizer_config.json declares when that is the generic fast one.

    transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type (a qwen2 model gets
    Qwen2Tokenizer, whose byte-level pre-tokenizer drops the tiny model's newline token) even when
    tokenizer_config.json names ``PreTrainedTokenizerFast``; every part of slime_hydra loads tokenizers here so
    the tiny tokenizer comes back exactly as it was saved (model/tiny.py).
    """
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.exists() and json.loads(config_file.read_text()).get("tokenizer_class") == GENERIC_TOKENIZER:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer  # imports transformers' model registry (~3 s of CPU): only when needed

    return AutoTokenizer.from_pretrained(str(path))


GENERIC_TOKENIZER = "PreTrainedTokenizerFast"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
"""The files an HF checkpoint's tokenizer may consist of."""


def copy_tokenizer(model_path: str | Path, out: str | Path) -> list[str]:
    """Copy the tokenizer's files (TOKENIZER_FILES that ``model_path`` has) into ``out``, as they are (the tokenizer
    never trains, and a copy is exact where a save_pretrained round trip may rename its class); returns their
    names."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (Path(model_path) / name).is_file():
            shutil.copyfile(Path(model_path) / name, Path(out) / name)
            copied.append(name)
    return copied


def save_tokenizer(tokenizer, save_dir) -> None:
    """save_pretrained, declaring the generic fast class so ``model.hf.load_tokenizer`` restores it exactly."""
    tokenizer.save_pretrained(save_dir)
    config_file = Path(save_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = GENERIC_TOKENIZER
    config_file.write_text(json.dumps(config, indent=2))


def hf_config(model: ModelConfig, **overrides) -> "PretrainedConfig":
    """The transformers config of this architecture: the dense families; Qwen3-MoE (every layer sparse, top-k weights
    renormalised, no shared expert); GLM-4.5 (glm4_moe: GLM-4.5-Air's attention, q/k/v biases, no q/k norm, RoPE on
    half of each head; the sigmoid router with DeepSeek's groups, scaling, shared experts and dense first layers of
    the model option); DeepSeek-V3 (the same router and layout, multi-latent attention of the option's widths,
    transformers' default interleaved RoPE layout, no rope scaling)."""
    from transformers import (DeepseekV3Config, Glm4Config, Glm4MoeConfig, LlamaConfig, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    common = dict(
        num_hidden_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_kv_heads,
        intermediate_size=model.ffn_hidden_size, vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=model.tie_word_embeddings,
        rope_theta=model.rope_theta,
    )
    if model.head_dim is not None:
        common["head_dim"] = model.head_dim
    classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "glm4": Glm4Config,
               "qwen3_moe": Qwen3MoeConfig, "glm4_moe": Glm4MoeConfig, "deepseek_v3": DeepseekV3Config}
    if model.family == "qwen3_moe":
        common.update(num_experts=model.num_experts, num_experts_per_tok=model.moe_top_k,
                      moe_intermediate_size=model.moe_ffn_hidden_size, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])
    if model.family in GROUPED_ROUTER_FAMILIES:
        common.update(n_routed_experts=model.num_experts, num_experts_per_tok=model.moe_top_k,
                      moe_intermediate_size=model.moe_ffn_hidden_size, n_shared_experts=model.moe_shared_experts,
                      first_k_dense_replace=model.first_dense_layers, n_group=model.moe_groups,
                      topk_group=model.moe_group_top_k, routed_scaling_factor=model.moe_routed_scaling,
                      norm_topk_prob=True)
    if model.family == "glm4_moe":
        common.update(attention_bias=True, use_qk_norm=False)
    if model.is_mla:
        common.update(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
                      qk_nope_head_dim=model.qk_nope_head_dim, qk_rope_head_dim=model.qk_rope_head_dim,
                      v_head_dim=model.v_head_dim)
    if model.family not in classes:
        raise ValueError(f"model.family={model.family}: random-init building supports {sorted(classes)}")
    config = classes[model.family](**{**common, **overrides})
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):  # family defaults index the real vocabulary
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= model.vocab_size and attr not in overrides:
            setattr(config, attr, None)
    return config


def build_random_checkpoint(model: ModelConfig, out_dir: Path, seed: int = 0, dtype: Optional["torch.dtype"] = None,
                            tokenizer: Optional[object] = None, **overrides) -> Path:
    """Save a randomly initialised HF checkpoint of this architecture to out_dir (safetensors; ``dtype`` default
    fp32); return out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = hf_config(model, **overrides)
    net = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    net.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
    return out_dir
