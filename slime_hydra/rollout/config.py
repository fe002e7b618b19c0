"""Rollout group schema: engines, router, sampling, batch sizes in prompts and samples.

One rollout step takes ``batch_prompts`` prompts and samples ``n_samples_per_prompt`` responses each, so it yields
``batch_prompts * n_samples_per_prompt`` samples; the trainer consumes them in ``train.global_batch_samples``-sized
optimizer steps (see config/derive.py).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

from slime_hydra.options import Problem, choice, non_negative, positive, within
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
ROUTER_POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")
"""rollout.router_policy: the sglang-router load-balancing policies the platform drives (rollout/router.py)."""


@dataclass
class RolloutConfig:
    backend: str = choice("embedded", ENGINE_KINDS)
    """The engine kind (rollout/engines/kinds.py): embedded (a transformers engine speaking SGLang's protocol) |
    sglang (real SGLang servers)."""
    batch_prompts: int = positive(32)
    """Prompts per rollout step (slime's rollout_batch_size)."""
    n_samples_per_prompt: int = positive(8)
    """Responses sampled per prompt (the GRPO group size)."""
    over_sampling_batch_prompts: Optional[int] = positive(None)
    """Prompts sent per rollout step when a dynamic filter drops groups (>= batch_prompts); null means batch_prompts."""
    max_response_tokens: int = positive(1024)
    """Response budget per sample in tokens (SGLang max_new_tokens)."""
    temperature: float = non_negative(1.0)
    """Sampling temperature for training rollouts."""
    top_p: float = within(1.0, 0.0, 1.0, low_open=True)
    """Nucleus sampling mass; 1.0 disables."""
    top_k: int = within(-1, -1)
    """Top-k sampling; -1 disables."""
    num_gpus: Optional[int] = positive(None)
    """GPUs running engines; null means train.num_gpus when colocated, else must be set (on CPU: engine processes)."""
    gpus_per_engine: int = positive(1)
    """GPUs per engine = the engine's tensor-parallel size."""
    max_concurrency_per_engine: int = positive(256)
    """In-flight /generate requests per engine (the manager's cap follows engines added and removed mid-run)."""
    router_policy: str = choice("round_robin", ROUTER_POLICIES)
    """sglang-router load-balancing policy: round_robin | cache_aware | random | power_of_two."""
    partial_rollout: bool = False
    """Aborted (over-sampled) groups go back to the buffer and resume later instead of being discarded."""
    max_filter_attempts: int = positive(3)
    """Generation rounds per batch before the buffer tops the batch up with filtered-out groups (>= 1)."""
    elastic: bool = False
    """Engines follow the Ray cluster's nodes while the run goes on: a node that joins gets engines on its free
    resources (rollout.gpus_per_engine GPUs each; one engine on a CPU node), the engines of a node that leaves are
    dropped and the run goes on with the others (rollout/elastic.py)."""
    health_check_interval_s: float = non_negative(2.0)
    """Seconds between the rollout manager's checks of every engine (process alive + GET /health); 0 disables."""
    max_generate_retries: int = non_negative(3)
    """Retries, through the router, of a /generate that could not reach an engine (connection error, router 502/503),
    before the rollout stops with an error naming the engine and the cause; 0 means no retry."""
    generate: Optional[str] = None
    """Dotted path of a custom ``async def generate(ctx, sample, sampling_params)`` hook (multi-turn, tools;
    rollout/generate.py); null uses the default single-call generate."""
    eval_every_steps: int = non_negative(0)
    """Evaluate on data.eval every N rollout steps (and at step 0 and the end); 0 disables."""
    sglang: Dict[str, Any] = field(default_factory=dict)
    """Passthrough SGLang ServerArgs (e.g. mem_fraction_static: 0.8), checked against a pinned snapshot of the names."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.top_k == 0:
            yield Problem((f"{prefix}top_k",), "top_k=0 keeps no token", f"set {prefix}top_k=-1 (off) or a value >= 1")
        if self.over_sampling_batch_prompts is not None and self.over_sampling_batch_prompts < self.batch_prompts:
            yield Problem((f"{prefix}over_sampling_batch_prompts", f"{prefix}batch_prompts"),
                          f"over-sampling sends {self.over_sampling_batch_prompts} prompts but a step needs "
                          f"{self.batch_prompts}", f"set {prefix}over_sampling_batch_prompts >= {self.batch_prompts} or null")
        if self.generate is not None and "." not in self.generate:
            yield Problem((f"{prefix}generate",), f"'{self.generate}' is not a dotted path",
                          f"set {prefix}generate=my_pkg.module.generate")
        kind = ENGINE_KINDS.get(self.backend)
        if kind is not None and kind.max_gpus_per_engine is not None and self.gpus_per_engine > kind.max_gpus_per_engine:
            wider = [k.name for k in ENGINE_KINDS.values() if k.max_gpus_per_engine is None]
            yield Problem((f"{prefix}gpus_per_engine", f"{prefix}backend"),
                          f"an engine of rollout={self.backend} runs on at most {kind.max_gpus_per_engine} GPU(s), "
                          f"not rollout.gpus_per_engine={self.gpus_per_engine}",
                          f"set rollout.gpus_per_engine={kind.max_gpus_per_engine} (more engines: rollout.num_gpus)"
                          + (f", or rollout={wider[0]} for TP engines" if wider else ""))
