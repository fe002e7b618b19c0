"""Rollout group schema: engines, router, sampling, batch sizes in prompts and samples.

One rollout step takes ``batch_prompts`` prompts and samples ``n_samples_per_prompt`` responses each, so it yields
``batch_prompts * n_samples_per_prompt`` samples; the trainer consumes them in ``train.global_batch_samples``-sized
optimizer steps (see config/derive.py).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class RolloutConfig:
    backend: str = "embedded"
    """embedded (transformers engine speaking SGLang's protocol) | sglang (real SGLang servers)."""
    batch_prompts: int = 32
    """Prompts per rollout step (slime's rollout_batch_size)."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    over_sampling_batch_prompts: Optional[int] = None
    """Prompts sent per rollout step when a dynamic filter drops groups (>= batch_prompts); null means batch_prompts."""
    max_response_tokens: int = 8
    """Response budget per sample in tokens (SGLang max_new_tokens)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    num_gpus: Optional[int] = None
    """GPUs running engines; null means train.num_gpus when colocated, else must be set (on CPU: engine processes)."""
    gpus_per_engine: int = 1
    """GPUs per engine = the engine's tensor-parallel size."""
    max_concurrency_per_engine: int = 256
    """In-flight /generate requests per engine."""
    router_policy: str = "round_robin"
    """sglang-router load-balancing policy: round_robin | cache_aware | random | power_of_two."""
    partial_rollout: bool = False
    """Aborted (over-sampled) groups go back to the buffer and resume later instead of being discarded."""
    max_filter_attempts: int = 3
    """Generation rounds per batch before the buffer tops the batch up with filtered-out groups (>= 1)."""
    health_check_interval_s: float = 2.0
    """Seconds between the rollout manager's checks of every engine (process alive + GET /health); 0 disables."""
    max_generate_retries: int = 3
    """Retries, through the router, of a /generate that could not reach an engine (connection error, router 502/503),
    before the rollout stops with an error naming the engine and the cause; 0 means no retry."""
    generate: Optional[str] = None
    """Dotted path of a custom async generate(cfg, sample, sampling_params) hook (multi-turn, tools); null default."""
    eval_every_steps: int = 0
    """Evaluate on data.eval every N rollout steps (and at step 0 and the end); 0 disables."""
    sglang: Dict[str, Any] = field(default_factory=dict)
    """Passthrough SGLang ServerArgs (e.g. mem_fraction_static: 0.8), checked against a pinned snapshot of the names."""
