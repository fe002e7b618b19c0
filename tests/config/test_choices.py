"""One home per option: every choice a schema declares is what the implementing code accepts, and the composed
default config has a domain for every number and choice-like string the platform interprets."""

from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Choice, domain_of
from slime_hydra.rollout.config import ROUTER_POLICIES, RolloutConfig
from slime_hydra.train.config import LR_DECAY_STYLES, WEIGHT_SYNC_METHODS, TrainConfig


def test_implementations_match_the_declared_choices():
    import importlib

    from slime_hydra.train.backend import TrainBackend
    from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS
    from slime_hydra.train.optim import DECAY

    assert domain_of(TrainConfig, "backend").choices is TRAIN_BACKEND_KINDS  # the registry itself, read live
    for kind in TRAIN_BACKEND_KINDS.values():  # each record's class implements the protocol
        module, name = kind.cls.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module), name), TrainBackend), kind
    assert set(DECAY) == set(LR_DECAY_STYLES)
    assert domain_of(TrainConfig, "weight_sync").choices == ("auto",) + WEIGHT_SYNC_METHODS
    from slime_hydra.rollout.engines.kinds import ENGINE_KINDS

    for engine in ENGINE_KINDS.values():  # what an engine kind takes is a method train/weight_sync.py sends
        assert set(engine.weight_syncs) <= set(WEIGHT_SYNC_METHODS) and engine.colocated_sync in engine.weight_syncs
    assert domain_of(RolloutConfig, "router_policy").choices == ROUTER_POLICIES
    from slime_hydra.reward.registry import BUILTINS, NAMES

    assert set(NAMES) == set(BUILTINS) | {"remote", "custom"}
    # algo/: the functions import their names from algo/config.py (tests/algo parametrize over the same tuples)


def test_every_string_option_with_fixed_values_declares_them():
    """Strings the code branches on are Choices (free-form strings: names, paths, dotted targets are not)."""
    import dataclasses

    free = {"name", "path", "target", "url", "reward_key", "prompt_key", "label_key", "metadata_key", "tools_key",
            "response_key", "rejected_key", "generate", "dynamic_filter", "rollout_path", "resume", "output_dir", "run_name",
            "partition", "account", "qos", "constraint", "job_body", "wandb_project", "wandb_entity", "wandb_group"}
    missing = []
    for group in dataclasses.fields(SlimeConfig):
        schema = group.type if dataclasses.is_dataclass(group.type) else None
        fields = dataclasses.fields(schema) if schema else [group]
        owner = schema or SlimeConfig
        for f in fields:
            if f.type in (str, "str") and f.name not in free and not isinstance(f.metadata.get("domain"), Choice):
                missing.append(f"{owner.__name__}.{f.name}")
    assert missing == []
