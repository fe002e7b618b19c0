"""Train backend kinds: one record each, everything the platform knows about a trainer implementation.

    kind = TRAIN_BACKEND_KINDS[cfg.train.backend]   # train.backend's domain is these keys
    kind.cls                                        # the TrainBackend class every rank builds (train/group.py)
    kind.parallelism, kind.sharding                 # what splits a model replica; how the memory plan counts a rank
    kind.packing, kind.lora, kind.moe               # packed rows, LoRA adapters, MoE families: trained or refused
    kind.checkpoint_slots                           # how many processes export.py needs to read a checkpoint
    kind.options_key, kind.rules                    # its passthrough options; the config rules of its own limits

Rules (config/rules.py), the memory plan, the train group and export.py ask the record; no code compares a
backend's name. Adding a backend is one ``register(TrainBackendKind(...))`` here, a class with the semantics of
train/backend.TrainBackend, and its tests (the model families it trains list it: model/families.py).
"""

from dataclasses import dataclass
from typing import Optional

PARALLEL_DIMS = ("tp", "pp", "cp", "ep")
"""The train config's model-parallel sizes (tensor, pipeline, context, expert)."""


@dataclass(frozen=True)
class TrainBackendKind:
    name: str
    """train.backend."""
    cls: str
    """Dotted path of its TrainBackend class (each rank imports it: a rank loads one backend)."""
    parallelism: tuple[str, ...]
    """Which of PARALLEL_DIMS split one model replica over ranks (none: every rank is a data-parallel rank)."""
    sharding: str
    """How a rank holds the model, for the memory plan: ``fully_sharded`` (FSDP2: parameters, gradients and Adam
    state split over every rank, two layers gathered at a time) or ``model_parallel`` (megatron: parameters split
    over TP x PP, routed experts over TP x EP, Adam state over the DP x CP peers, ZeRO-1)."""
    checkpoint_slots: str
    """What export.py starts to read a checkpoint: ``any`` (one process: torch's DCP reshards) or ``per_slot`` (one
    process per TP rank x PP stage x EP rank, as its files are)."""
    packing: bool
    """It trains on packed rows (train.pack_sequences; its own limits beyond that are in ``rules``)."""
    lora: bool
    """It trains LoRA adapters (train.lora.rank > 0)."""
    moe: bool
    """It trains mixture-of-experts families (a family record's ``moe``)."""
    batch_invariant: bool = False
    """Its forward can be the batch-invariant one of algo.true_on_policy (model/invariant.py)."""
    options_key: Optional[str] = None
    """The config key of its passthrough options (train.megatron), refused for any other backend."""
    rules: Optional[str] = None
    """Dotted path of ``fn(cfg, derived) -> Iterator[Problem]``: what it refuses of a config beyond the rules every
    backend shares (config/rules.py runs it)."""

    def export_processes(self, tp: int, pp: int, ep: int) -> int:
        """Processes export.py runs to read a checkpoint saved at this tp, pp, ep."""
        return 1 if self.checkpoint_slots == "any" else tp * pp * ep


TRAIN_BACKEND_KINDS: dict[str, TrainBackendKind] = {}
"""train.backend -> its record (``register`` adds one)."""


def register(kind: TrainBackendKind) -> TrainBackendKind:
    TRAIN_BACKEND_KINDS[kind.name] = kind
    return kind


register(TrainBackendKind("fsdp", "slime_hydra.train.fsdp.FSDPBackend", parallelism=(), sharding="fully_sharded",
                          checkpoint_slots="any", packing=True, lora=True, moe=True, batch_invariant=True))
register(TrainBackendKind("megatron", "slime_hydra.train.megatron.backend.MegatronBackend", parallelism=PARALLEL_DIMS,
                          sharding="model_parallel", checkpoint_slots="per_slot", packing=True, lora=True, moe=True,
                          batch_invariant=True, options_key="train.megatron",
                          rules="slime_hydra.config.backend_rules.megatron_problems"))
