"""Values computed from the config, never written back into it (one source of truth per number).

    samples_per_rollout = rollout.batch_prompts * rollout.n_samples_per_prompt
                        = global_batch_samples * optimizer_steps_per_rollout
    dp          = train.num_gpus / (tp * pp * cp)
    rollout_gpus = rollout.num_gpus, or train.num_gpus when colocated
    total_gpus  = max(train, rollout) when colocated, else train + rollout
    nodes       = ceil(total_gpus / cluster.gpus_per_node)   (CPU-only: cluster.nodes, else 1)
    engine_dtype = bfloat16 when training bf16 on GPUs, else float32 (engines compute in the dtype weights are
                   synced in)
    weight_sync = train.weight_sync, with auto resolved from the placement and the engine kind
    lora_sync   = train.lora.sync with auto resolved (adapter to separate embedded engines without trained biases,
                  else merged), or None
    batch_invariant_engines = algo.true_on_policy or deterministic (model/invariant.py)

``derive`` assumes the counts are positive; config/rules.py checks that first and only then derives.
"""

import math
from dataclasses import dataclass

from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.train.config import LoraConfig


@dataclass(frozen=True)
class Derived:
    samples_per_rollout: int
    """Samples one rollout step produces (prompts x samples per prompt)."""
    global_batch_samples: int
    """Samples per optimizer step (train.global_batch_samples, or derived)."""
    optimizer_steps_per_rollout: int
    """Optimizer steps per rollout batch (train.optimizer_steps_per_rollout, or derived)."""
    dp: int
    """Data-parallel size of the trainer."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on one rank: global / (micro * dp)."""
    train_gpus: int
    """GPUs (CPU processes on a CPU machine) of the training ranks."""
    rollout_gpus: int
    """GPUs (CPU processes) of the engines."""
    num_engines: int
    """Rollout engines: rollout_gpus / gpus_per_engine."""
    total_gpus: int
    """GPUs the job needs."""
    gpus_per_node: int
    """GPUs per node used for placement (the cluster's; total_gpus on a CPU-only machine)."""
    nodes: int
    """Nodes the job needs."""
    context_tokens: int
    """Longest sequence: data.max_prompt_tokens + rollout.max_response_tokens."""
    engine_dtype: str
    """The engines' compute dtype and the dtype weights are synced in: bfloat16 | float32 (torch names)."""
    weight_sync: str
    """How weights reach the engines: one of train/config.WEIGHT_SYNC_METHODS (``auto`` resolved)."""
    lora_sync: str | None = None
    """What a LoRA policy sends: merged | adapter (train/config.LORA_SYNC); None without LoRA."""
    batch_invariant_engines: bool = False
    """The engines compute every token whatever shares its batch (algo.true_on_policy, deterministic)."""


def bundle_nodes(cfg: SlimeConfig, d: Derived) -> list[int]:
    """The node (0-based; 0 is the Ray head's) of each placement bundle; bundles are the trainer's ranks first, then
    (disaggregated) the engines'. One entry per bundle, so built only where a run places its bundles or a plan lists
    them, never while validating (which meets counts of any size).

    GPU sites fill nodes in order, gpus_per_node bundles each: bundle b on node b // gpus_per_node. CPU-only sites
    (nodes = cluster.nodes) deal the bundles round-robin, b on node b % nodes, so the processes spread evenly: 2 ranks
    and 2 engines on 2 nodes put rank i and engine i on node i."""
    per_node = cfg.cluster.gpus_per_node
    return [b // per_node if per_node else b % d.nodes for b in range(d.total_gpus)]


def node_roles(cfg: SlimeConfig, d: Derived) -> list[list[str]]:
    """What runs on each node (``bundle_nodes``): ``[["train rank 0", "engine 0"], ["train rank 1", ...]]`` (the
    driver, the rollout manager and the router run on node 0, the Ray head, besides)."""
    where = bundle_nodes(cfg, d)
    roles: list[list[str]] = [[] for _ in range(d.nodes)]
    for rank in range(d.train_gpus):
        roles[where[rank]].append(f"train rank {rank}")
    if cfg.debug.mode != "train_only":
        first = 0 if cfg.cluster.colocate else d.train_gpus
        for engine in range(d.num_engines):
            roles[where[first + engine * cfg.rollout.gpus_per_engine]].append(f"engine {engine}")
    return roles


def resolve_weight_sync(weight_sync: str, colocate: bool, engine: str, lora_sync: str | None = None) -> str:
    """train.weight_sync with ``auto`` resolved, as the engine kind's record says (rollout/engines/kinds.py):
    colocated engines take their ``colocated_sync`` (embedded: CUDA IPC handles, ``tensor``; SGLang: a reload from
    ``disk``, the handles being in the embedded engine's format), separate GPUs get an NCCL broadcast
    (``distributed``); engines that take adapters only as directories (SGLang's /load_lora_adapter) read the LoRA
    adapter alone from ``disk``."""
    if weight_sync == "auto":
        kind = ENGINE_KINDS[engine]
        if kind.adapters == "directory" and lora_sync == "adapter":
            return "disk"
        return kind.colocated_sync if colocate else "distributed"
    return weight_sync


def resolve_lora_sync(lora: LoraConfig, engine: str, colocate: bool) -> str | None:
    """train.lora.sync with ``auto`` resolved, to the cheaper path that is valid (docs/benchmarks.md, "LoRA on one
    H100"): engines on GPUs of their own get the adapter alone (18x fewer bytes than the whole 0.5B model over the
    wire), if they apply adapters in place (the kind's ``adapters`` is ``any``: embedded engines) and the adapter is
    all that trained (lora.bias=none);
    colocated engines get merged weights (a device-to-device copy, and the engine then decodes the plain model:
    its rollout was 1.6-1.9 s a step against 2.0-2.6 s with run-time adapters); SGLang engines get merged weights.
    None when LoRA is off."""
    if not lora.enabled:
        return None
    if lora.sync == "auto":
        return "adapter" if ENGINE_KINDS[engine].adapters == "any" and lora.bias == "none" and not colocate else "merged"
    return lora.sync


def gpu_hours_for(derived: Derived, time_min: int) -> float:
    """GPU-hours an allocation of derived.nodes x gpus_per_node reserves for time_min minutes."""
    return derived.nodes * derived.gpus_per_node * time_min / 60.0


def derive(cfg: SlimeConfig) -> Derived:
    """Compute the derived values. Raises ZeroDivisionError/ValueError only on configs rules.py rejects first."""
    samples = cfg.rollout.batch_prompts * cfg.rollout.n_samples_per_prompt
    global_batch = cfg.train.global_batch_samples
    steps = cfg.train.optimizer_steps_per_rollout
    if global_batch is None and steps is None:
        global_batch, steps = samples, 1
    elif global_batch is None:
        global_batch = samples // steps
    elif steps is None:
        steps = max(samples // global_batch, 1)

    dp = cfg.train.num_gpus // cfg.train.model_parallel_size
    train_gpus = cfg.train.num_gpus
    if cfg.rollout.num_gpus is not None:
        rollout_gpus = cfg.rollout.num_gpus
    else:
        rollout_gpus = train_gpus if cfg.cluster.colocate else 0
    total = max(train_gpus, rollout_gpus) if cfg.cluster.colocate else train_gpus + rollout_gpus
    nodes = math.ceil(total / cfg.cluster.gpus_per_node) if cfg.cluster.gpus_per_node else cfg.cluster.nodes or 1
    per_node = cfg.cluster.gpus_per_node or math.ceil(total / nodes)
    lora_sync = resolve_lora_sync(cfg.train.lora, cfg.rollout.backend, cfg.cluster.colocate)
    return Derived(
        samples_per_rollout=samples,
        global_batch_samples=global_batch,
        optimizer_steps_per_rollout=steps,
        dp=dp,
        grad_accum_steps=max(global_batch // (cfg.train.micro_batch_samples * max(dp, 1)), 1),
        train_gpus=train_gpus,
        rollout_gpus=rollout_gpus,
        num_engines=rollout_gpus // cfg.rollout.gpus_per_engine,
        total_gpus=total,
        gpus_per_node=per_node,
        nodes=nodes,
        context_tokens=cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens,
        engine_dtype="bfloat16" if cfg.cluster.gpus_per_node > 0 and cfg.train.dtype == "bf16" else "float32",
        weight_sync=resolve_weight_sync(cfg.train.weight_sync, cfg.cluster.colocate, cfg.rollout.backend, lora_sync),
        lora_sync=lora_sync,
        batch_invariant_engines=cfg.algo.true_on_policy or cfg.deterministic,
    )
