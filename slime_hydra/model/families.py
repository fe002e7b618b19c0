"""Model families: one record each, everything the platform knows about an architecture.

    family = FAMILIES[cfg.model.family]     # model.family's domain is FAMILIES' keys
    family.hf_config_class, family.fields   # ModelConfig field -> config.json key, used both ways (model/hf.py
                                            # writes configs, config/files.py reads a checkpoint's against the option)
    family.moe, family.grouped_router, family.latent_attention, family.qkv_bias, ...   # the layout
    family.backends, family.engines         # which train backends and engine kinds run it

Rules (config/rules.py), the memory plan, random-init building (model/hf.py), config.json checks (config/files.py)
and train=megatron's conversion (train/megatron/model.py) ask the record; no code compares a family's name.
Adding a family is one ``register(Family(...))`` here (and its ``conf/model/<option>.yaml``), plus its tests
(docs/architecture.md, "Adding code").
"""

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

DENSE_FIELDS = MappingProxyType({
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size", "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta", "head_dim": "head_dim",
})
"""ModelConfig field -> HF config.json key, for every family."""
EXPERT_FIELDS = MappingProxyType({"num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                                  "moe_ffn_hidden_size": "moe_intermediate_size"})
"""The MoE fields of Qwen3-MoE's config."""
GROUPED_ROUTER_FIELDS = MappingProxyType({
    "num_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok", "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_shared_experts": "n_shared_experts", "first_dense_layers": "first_k_dense_replace", "moe_groups": "n_group",
    "moe_group_top_k": "topk_group", "moe_routed_scaling": "routed_scaling_factor",
})
"""The MoE fields of DeepSeek's layout (GLM-4.5, DeepSeek-V3)."""
LATENT_FIELDS = MappingProxyType({name: name for name in
                                  ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")})
"""Multi-latent attention's widths (DeepSeek-V3)."""
NULL_IS_A_VALUE = ("q_lora_rank",)
"""Fields whose null a config takes as a value (q_lora_rank: queries projected from the hidden state directly);
the other null fields are left to transformers' default (head_dim: hidden_size / heads)."""
ALIASES = MappingProxyType({"vocab_size": ("padded_vocab_size",)})
"""Other config.json keys a checkpoint may hold a field under (read only: GLM's original configs)."""

TRAIN_BACKENDS_ALL = ("fsdp", "megatron")
ENGINES_ALL = ("embedded", "sglang")


@dataclass(frozen=True)
class Family:
    name: str
    """model.family, and the HF config's ``model_type``."""
    hf_config_class: str
    """transformers' config class (``transformers.<name>``): random-init builds of a model option."""
    rotary_class: str
    """transformers' RoPE module of the family (train=megatron takes the inverse frequencies from it)."""
    fields: Mapping[str, str] = field(default_factory=lambda: DENSE_FIELDS)
    """ModelConfig field -> config.json key: written by model/hf.hf_config, compared by config/files.py."""
    fixed: Mapping[str, object] = field(default_factory=dict)
    """config.json values a random-init build of this family always has (what its ModelConfig fields do not say)."""
    qkv_bias: str = "o_too"
    """'always' (Qwen2), 'config' (config.attention_bias; q/k/v only), 'o_too' (attention_bias also puts a bias on
    o_proj, which megatron cannot express without biasing the MLP too: refused), or 'never' (DeepSeek-V3: its
    attention_bias would bias the latent and output projections: refused)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""
    sandwich_norm: bool = False
    """Extra RMSNorms on the attention and MLP outputs before the residual adds (GLM-4)."""
    fused_gate_up: bool = False
    """HF stores gate and up as one [2F, H] ``gate_up_proj`` (GLM-4): train.lora cannot name gate_proj / up_proj."""
    rotary_interleaved: bool = False
    """RoPE rotates pairs (x0, x1), (x2, x3) ... (GLM-4) instead of (x_i, x_{i + d/2})."""
    moe: bool = False
    """Sparse layers hold a router and experts (model.num_experts > 0)."""
    grouped_router: bool = False
    """DeepSeek's MoE layout: sigmoid scores plus a fixed correction bias choose the experts (group-limited:
    model.moe_groups, moe_group_top_k), the chosen scores renormalised and scaled by model.moe_routed_scaling, shared
    experts (model.moe_shared_experts) and dense first layers (model.first_dense_layers)."""
    latent_attention: bool = False
    """Multi-latent attention (model.q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
    backends: tuple[str, ...] = TRAIN_BACKENDS_ALL
    """The train backends that run it (train=fsdp: transformers' modeling; train=megatron: a conversion)."""
    engines: tuple[str, ...] = ENGINES_ALL
    """The engine kinds that serve it."""

    def config_json_keys(self, model_field: str) -> tuple[str, ...]:
        """The config.json keys that may hold ``model_field`` in a checkpoint of this family (first present wins)."""
        return (self.fields[model_field],) + ALIASES.get(model_field, ()) if model_field in self.fields else ()


FAMILIES: dict[str, Family] = {}
"""model.family -> its record (``register`` adds one)."""


def register(family: Family) -> Family:
    """Add a family (its name becomes a valid model.family)."""
    FAMILIES[family.name] = family
    return family


_TRANSFORMERS = "transformers.models"
register(Family("qwen2", "Qwen2Config", f"{_TRANSFORMERS}.qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
                qkv_bias="always"))
register(Family("qwen3", "Qwen3Config", f"{_TRANSFORMERS}.qwen3.modeling_qwen3.Qwen3RotaryEmbedding", qk_norm=True))
register(Family("llama", "LlamaConfig", f"{_TRANSFORMERS}.llama.modeling_llama.LlamaRotaryEmbedding"))
register(Family("glm4", "Glm4Config", f"{_TRANSFORMERS}.glm4.modeling_glm4.Glm4RotaryEmbedding", qkv_bias="config",
                sandwich_norm=True, fused_gate_up=True, rotary_interleaved=True))
register(Family("qwen3_moe", "Qwen3MoeConfig", f"{_TRANSFORMERS}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding",
                fields={**DENSE_FIELDS, **EXPERT_FIELDS}, qk_norm=True, moe=True,
                fixed={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}))
register(Family("glm4_moe", "Glm4MoeConfig", f"{_TRANSFORMERS}.glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding",
                fields={**DENSE_FIELDS, **GROUPED_ROUTER_FIELDS}, qkv_bias="config", moe=True, grouped_router=True,
                fixed={"norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False}))
register(Family("deepseek_v3", "DeepseekV3Config",
                f"{_TRANSFORMERS}.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding",
                fields={**DENSE_FIELDS, **GROUPED_ROUTER_FIELDS, **LATENT_FIELDS}, qkv_bias="never", moe=True,
                grouped_router=True, latent_attention=True, fixed={"norm_topk_prob": True}))
