"""Checks the passthrough dicts ``rollout.sglang`` and ``train.megatron`` against the real option names.

``rollout.sglang``: a pinned snapshot of SGLang's ``ServerArgs`` fields (``slime_hydra/snapshots/``,
``options.snapshot``), since SGLang is not installed on login nodes (nor here). ``train.megatron``: the fields of
megatron-core's TransformerConfig itself, which the backend passes the dict to (megatron-core is a dependency).
Options the platform sets itself (model path, ports, parallel sizes, architecture numbers ...) are refused with a
pointer to the key that owns them: setting them twice would make two sources of truth. SGLang's list of those, and
the check of values against SGLang's types, live with the command line they shape (rollout/engines/sglang.py);
Megatron's are here, since only validation reads them.
"""

import typing
from typing import Iterator, Optional

from slime_hydra.options import Problem, nearest
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS
from slime_hydra.rollout.engines.sglang import check_sglang_names, value_problems

MEGATRON_OWNED = {
    "tensor_model_parallel_size": "train.tp",
    "pipeline_model_parallel_size": "train.pp",
    "context_parallel_size": "train.cp",
    "expert_model_parallel_size": "train.ep",
    "params_dtype": "train.dtype",
    "pipeline_dtype": "train.dtype",
    "bf16": "train.dtype",
    "fp16": "train.dtype",
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_kv_heads",
    "kv_channels": "model.head_dim",
    "num_moe_experts": "model.num_experts",
    "moe_router_topk": "model.moe_top_k",
    "moe_ffn_hidden_size": "model.moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "model.moe_shared_experts",
    "moe_router_num_groups": "model.moe_groups",
    "moe_router_group_topk": "model.moe_group_top_k",
    "moe_router_topk_scaling_factor": "model.moe_routed_scaling",
    "q_lora_rank": "model.q_lora_rank",
    "kv_lora_rank": "model.kv_lora_rank",
    "qk_head_dim": "model.qk_nope_head_dim",
    "qk_pos_emb_head_dim": "model.qk_rope_head_dim",
    "v_head_dim": "model.v_head_dim",
    **{name: "model.family (the checkpoint's config.json sets it)" for name in (
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "rotary_interleaved", "moe_router_score_function", "moe_router_pre_softmax",
        "moe_router_enable_expert_bias", "moe_router_dtype", "rope_type", "rotary_scaling_factor", "mscale_all_dim")},
    "moe_token_dispatcher_type": "the backend (train/megatron/moe.py moves tokens its own way)",
    "transformer_impl": "the backend (TransformerEngine where it is installed)",
    "moe_router_bias_update_rate": "the backend (the correction bias stays as loaded)",
}
"""TransformerConfig fields train/megatron/model.transformer_config sets from the config or the checkpoint -> the key
that owns them."""


def megatron_problems(options: dict, mla: bool) -> Iterator[Problem]:
    """train.megatron keys that are no field of megatron-core's TransformerConfig (MLATransformerConfig for
    multi-latent attention; the overrides the backend passes through), that the platform sets itself, or whose
    value is not of the field's type (bool, int, float, str, a choice, a list of those; fields of other types, such
    as callables and dtypes, cannot come from a config). megatron-core is a dependency, so its own dataclass is
    the domain, not a snapshot."""
    if not options:
        return
    from slime_hydra.train.megatron.model import config_field_types, config_schema

    types, schema = config_field_types(mla), config_schema(mla).__name__
    for key, value in options.items():
        dotted = f"train.megatron.{key}"
        if key in MEGATRON_OWNED:
            yield Problem((dotted,), f"'{key}' is owned by the platform", f"use {MEGATRON_OWNED[key]} instead")
        elif key not in types:
            hint = nearest(key, types)
            yield Problem((dotted,), f"'{key}' is not a field of megatron-core {schema}",
                          f"did you mean train.megatron.{hint}?" if hint else f"see megatron-core's {schema} fields")
        elif (expected := type_mismatch(types[key], value)) is not None:
            yield Problem((dotted,), f"{key}={value!r} is not {expected} ({schema}.{key})",
                          f"set train.megatron.{key} to {expected}")


def type_mismatch(hint, value) -> Optional[str]:
    """None when ``value`` (from YAML) fits the type hint ``hint``, else what the hint wants, in words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        wants = [type_mismatch(arg, value) for arg in args]
        return None if None in wants else " or ".join(wants)
    if hint is type(None):
        return None if value is None else "null"
    if origin is typing.Literal:
        return None if value in args else f"one of {list(args)}"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"a list of {args[0].__name__ if args and isinstance(args[0], type) else 'values'}"
        wants = [type_mismatch(args[0], v) for v in value] if args else []
        return next((f"a list of {w}" for w in wants if w is not None), None)
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return f"a {getattr(hint, '__name__', hint)} (not settable from a config)"


def check_passthrough(cfg) -> Iterator[Problem]:
    """Problems of rollout.sglang and train.megatron (cfg is a SlimeConfig)."""
    yield from check_sglang_names(cfg.rollout.sglang)
    yield from value_problems(cfg.rollout.sglang)  # rendered the way the launcher renders them
    yield from megatron_problems(cfg.train.megatron, cfg.model.is_mla)
    kind = ENGINE_KINDS.get(cfg.rollout.backend)
    if cfg.rollout.sglang and kind is not None and kind.options_key != "rollout.sglang":
        owner = next(k.name for k in ENGINE_KINDS.values() if k.options_key == "rollout.sglang")
        yield Problem(("rollout.sglang", "rollout.backend"),
                      f"SGLang options are set but rollout.backend={cfg.rollout.backend} would ignore them",
                      f"use rollout={owner}, or remove rollout.sglang")
    backend = TRAIN_BACKEND_KINDS.get(cfg.train.backend)
    if cfg.train.megatron and backend is not None and backend.options_key != "train.megatron":
        owner = next(k.name for k in TRAIN_BACKEND_KINDS.values() if k.options_key == "train.megatron")
        yield Problem(("train.megatron", "train.backend"),
                      f"Megatron options are set but train.backend={cfg.train.backend} would ignore them",
                      f"use train={owner}, or remove train.megatron")
