"""The config rules of one train backend's own limits, which its record names (train/kinds.py, ``rules``) and
config/rules.check_backend runs: what megatron-core (and this project's use of it) cannot do that train=fsdp can,
or does differently. Rules every backend shares stay in config/rules.py."""

from typing import Iterator

from slime_hydra.config.derive import Derived
from slime_hydra.config.rules import divisors
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem
from slime_hydra.train.config import megatron_lora_problems, megatron_moe_problems, megatron_packing_problem


def megatron_problems(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """train=megatron: expert parallelism, the grouped router's scoring, the vocabulary and multi-latent attention's
    rows split over TP, activation recompute (CUDA RNG states; routing replay across pipeline stages), padding-free
    micro-batches, LoRA (train/config.py's megatron_* checks, which the backend runs again at construction)."""
    t, m = cfg.train, cfg.model
    yield from megatron_moe_problems(t, m.num_experts)
    yield from _router_problems(cfg)
    if m.vocab_size % t.tp:
        yield Problem(("train.tp", "model.vocab_size"),
                      f"the vocabulary ({m.vocab_size} rows) is split over TP ranks: not divisible by "
                      f"train.tp={t.tp}", f"choose train.tp among {divisors(m.vocab_size)[:8]}")
    if m.is_mla:  # megatron splits the latent down projections' rows over TP
        for key, rows in (("q_lora_rank", m.q_lora_rank),
                          ("kv_lora_rank", (m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0))):
            if rows and rows % t.tp:
                yield Problem(("train.tp", f"model.{key}"), f"multi-latent attention's {key} projection has "
                              f"{rows} rows, not divisible by train.tp={t.tp}", f"choose train.tp among {divisors(rows)}")
    if t.gradient_checkpointing and cfg.cluster.gpus_per_node == 0:
        yield Problem(("train.gradient_checkpointing", "cluster.gpus_per_node"),
                      "megatron's activation recompute saves CUDA RNG states, and this is a CPU-only cluster",
                      "set train.gradient_checkpointing=false")
    if cfg.algo.routing_replay and t.pp > 1 and t.gradient_checkpointing:
        yield Problem(("algo.routing_replay", "train.gradient_checkpointing", "train.pp"), "megatron's activation "
                      "recompute routes again in the backward, and with train.pp > 1 a stage's backward of micro-batch "
                      "k runs after later micro-batches' forwards set the routers' replayed experts (not built: "
                      "setting them back before each backward)", "set train.gradient_checkpointing=false, or "
                      "train.pp=1")
    if problem := megatron_packing_problem(t, m.is_mla):
        yield problem
    if cfg.algo.true_on_policy and m.is_mla:
        yield Problem(("algo.true_on_policy", "model.kv_lora_rank"), "train=megatron has no batch-invariant form of "
                      "multi-latent attention (train/megatron/invariant.py)", "use train=fsdp, or set "
                      "algo.true_on_policy=false")
    if t.lora.enabled and m.is_mla:
        yield Problem(("train.lora.rank", "train.backend"), "LoRA on multi-latent attention is not built for "
                      "train=megatron", "use train=fsdp, or train.lora.rank=0")
    elif t.lora.enabled:
        yield from megatron_lora_problems(t.lora, t.tp, m.num_kv_heads, False, m.spec.qkv_bias == "always",
                                          t.megatron)


def _router_problems(cfg: SlimeConfig) -> Iterator[Problem]:
    """The grouped router's settings megatron's TopKRouter computes differently from transformers (train/megatron/
    model.py, which refuses them again at construction from the checkpoint's config)."""
    m = cfg.model
    if not m.spec.grouped_router or not m.is_moe or m.moe_group_top_k < 1:
        return
    if m.moe_top_k == 1:
        yield Problem(("model.moe_top_k", "train.backend"), "one expert per token: transformers renormalises its "
                      "weight to 1, megatron keeps the raw sigmoid score", "use train=fsdp for this model")
    if m.moe_group_top_k < m.moe_groups and m.moe_top_k // m.moe_group_top_k != 2:
        yield Problem(("model.moe_groups", "model.moe_group_top_k", "model.moe_top_k", "train.backend"),
                      f"group-limited routing with moe_top_k={m.moe_top_k} over moe_group_top_k={m.moe_group_top_k}: "
                      f"megatron scores a group by its best {m.moe_top_k // m.moe_group_top_k} experts, "
                      "transformers by its best 2", "use train=fsdp for this model")

