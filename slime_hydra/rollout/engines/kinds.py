"""Engine kinds: one record each, everything the platform knows about a kind of rollout engine.

    kind = ENGINE_KINDS[cfg.rollout.backend]      # rollout.backend's domain is ENGINE_KINDS' keys
    kind.weight_syncs, kind.colocated_sync        # what weight sync it takes (config/derive.py resolves ``auto``)
    kind.adapters, kind.routed_experts            # LoRA adapters at run time; the experts of every token
    kind.memory                                   # how the memory plan counts one of its GPUs
    kind.launcher, kind.commands                  # how its servers start (rollout/engines/actor.py; the dry run)

Rules (config/rules.py), derived values, the memory plan, the plan printout and the loop ask the record; no code
compares an engine kind's name. Adding a kind is one ``register(EngineKind(...))`` here, its server behind
sglang-router speaking the protocol of docs/architecture.md, and its tests.
"""

from dataclasses import dataclass
from typing import Optional

@dataclass(frozen=True)
class EngineKind:
    name: str
    """rollout.backend."""
    description: str
    """One line for rollout.backend's docs."""
    weight_syncs: tuple[str, ...]
    """The train.weight_sync methods it takes (each one of train/config.WEIGHT_SYNC_METHODS, train/weight_sync.py)."""
    colocated_sync: str
    """What train.weight_sync=auto resolves to when it shares the trainer's GPUs (else ``distributed``)."""
    adapters: str
    """How it takes a LoRA adapter alone: ``any`` (in place, by every weight sync method; the automatic choice for
    engines on GPUs of their own) or ``directory`` (only named adapters loaded from disk, /load_lora_adapter)."""
    routed_experts: bool
    """It reports each token's experts through the router (algo.routing_replay)."""
    memory: str
    """How the memory plan counts one engine GPU: ``measured`` (weights, slot KV cache and decode buffers, which
    rollout.max_concurrency_per_engine bounds) or ``fraction`` (it takes its mem_fraction_static of the GPU)."""
    max_gpus_per_engine: Optional[int]
    """The largest rollout.gpus_per_engine (tensor parallel size) it runs; None: no limit of its own."""
    needs_gpu: bool
    """It cannot run on a CPU-only cluster."""
    batch_invariant: bool = False
    """It computes every token as the batch-invariant trainer does (algo.true_on_policy; model/invariant.py)."""
    options_key: Optional[str] = None
    """The config key of its passthrough options (rollout.sglang), refused for any other kind."""
    launcher: Optional[str] = None
    """Dotted path of ``fn(cfg, dtype, model_path, adapter) -> launch`` giving EngineActor its server's command line
    (None: the embedded engine's own)."""
    commands: Optional[str] = None
    """Dotted path of ``fn(cfg, derived) -> list[str]``: its servers' command lines, printed by the dry run."""


ENGINE_KINDS: dict[str, EngineKind] = {}
"""rollout.backend -> its record (``register`` adds one)."""


def register(kind: EngineKind) -> EngineKind:
    ENGINE_KINDS[kind.name] = kind
    return kind


register(EngineKind(
    "embedded", "a transformers model behind SGLang's protocol (rollout/engines/embedded/)",
    weight_syncs=("distributed", "tensor", "disk"), colocated_sync="tensor", adapters="any", routed_experts=True, memory="measured",
    max_gpus_per_engine=1, needs_gpu=False, batch_invariant=True))
register(EngineKind(
    "sglang", "real SGLang servers (python -m sglang.launch_server; rollout/engines/sglang.py)",
    # CUDA IPC handles in the embedded engine's format, not SGLang's pickled one: colocated SGLang reloads from disk
    weight_syncs=("distributed", "disk"), colocated_sync="disk",
    adapters="directory",
    routed_experts=False,  # sglang-router 0.3.2 drops return_routed_experts from the /generate bodies it forwards
    memory="fraction", max_gpus_per_engine=None, needs_gpu=True, options_key="rollout.sglang",
    launcher="slime_hydra.rollout.engines.sglang.launch_for",
    commands="slime_hydra.rollout.engines.sglang.engine_commands"))
