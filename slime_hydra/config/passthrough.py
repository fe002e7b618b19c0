"""Checks the passthrough dicts ``rollout.sglang`` and ``train.megatron`` against pinned option names.

The snapshots (``slime_hydra/snapshots/*.json``, ``options.snapshot``) hold the real names: SGLang's ``ServerArgs``
fields and Megatron-LM's argparse destinations, so a login node without either package can refuse a typo. Options
the platform sets itself (model path, ports, parallel sizes, batch sizes ...) are refused with a pointer to the key
that owns them: setting them twice would make two sources of truth. SGLang's list of those, and the check of
values against SGLang's types, live with the command line they shape (rollout/engines/sglang.py); Megatron's are
here, since only validation reads them.
"""

from typing import Iterator

from slime_hydra.options import Problem, passthrough_problems
from slime_hydra.rollout.engines.sglang import check_sglang_names, value_problems

MEGATRON_OWNED = {
    "tensor_model_parallel_size": "train.tp",
    "pipeline_model_parallel_size": "train.pp",
    "context_parallel_size": "train.cp",
    "expert_model_parallel_size": "train.ep",
    "use_distributed_optimizer": "train.distributed_optimizer",
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_kv_heads",
    "kv_channels": "model.head_dim",
    "max_position_embeddings": "model.max_position_embeddings",
    "padded_vocab_size": "model.vocab_size",
    "vocab_size": "model.vocab_size",
    "untie_embeddings_and_output_weights": "model.tie_word_embeddings",
    "rotary_base": "model.rope_theta",
    "num_experts": "model.num_experts",
    "moe_router_topk": "model.moe_top_k",
    "moe_ffn_hidden_size": "model.moe_ffn_hidden_size",
    "seq_length": "data.max_prompt_tokens + rollout.max_response_tokens (derived)",
    "micro_batch_size": "train.micro_batch_samples",
    "global_batch_size": "train.global_batch_samples",
    "train_iters": "num_steps",
    "lr": "train.lr",
    "min_lr": "train.min_lr",
    "lr_warmup_iters": "train.lr_warmup_steps",
    "lr_decay_style": "train.lr_decay_style",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "adam_eps": "train.adam_eps",
    "clip_grad": "train.clip_grad",
    "bf16": "train.dtype",
    "fp16": "train.dtype",
    "seed": "seed",
    "load": "resume (checkpoints live in the run directory)",
    "save": "save_every_steps (checkpoints live in the run directory)",
}


def check_passthrough(cfg) -> Iterator[Problem]:
    """Problems of rollout.sglang and train.megatron (cfg is a SlimeConfig)."""
    yield from check_sglang_names(cfg.rollout.sglang)
    yield from value_problems(cfg.rollout.sglang)  # rendered the way the launcher renders them
    yield from passthrough_problems("train.megatron", cfg.train.megatron, "megatron_args", MEGATRON_OWNED)
    if cfg.rollout.sglang and cfg.rollout.backend != "sglang":
        yield Problem(("rollout.sglang", "rollout.backend"),
                      f"SGLang options are set but rollout.backend={cfg.rollout.backend} would ignore them",
                      "use rollout=sglang, or remove rollout.sglang")
    if cfg.train.megatron and cfg.train.backend != "megatron":
        yield Problem(("train.megatron", "train.backend"),
                      f"Megatron options are set but train.backend={cfg.train.backend} would ignore them",
                      "use train=megatron, or remove train.megatron")
