"""Registers every group's schema in Hydra's ConfigStore, in one place.

``base_config`` (the root schema, first in ``conf/config.yaml``'s defaults) types every group's slice, so an option
YAML under ``conf/<group>/`` merges into its typed slice and a misspelt key fails at composition. Each group's
schema is also stored as ``base_<group>``, for a site's own file that starts with ``defaults: [base_<group>,
_self_]`` (the shipped options leave that out: the schema loaded again for every group made each composition ~30%
slower). ``GROUP_SCHEMAS`` is also what config/keys.py walks to refuse unknown keys added with ``+``/``++`` and to
suggest the nearest valid name.
"""

from hydra.core.config_store import ConfigStore

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.config.schema import DebugConfig, SlimeConfig
from slime_hydra.data.config import DataConfig
from slime_hydra.model.config import ModelConfig
from slime_hydra.reward.config import RewardConfig
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.tracking.config import TrackingConfig
from slime_hydra.train.config import TrainConfig

GROUP_SCHEMAS = {
    "model": ModelConfig,
    "algo": AlgoConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "train": TrainConfig,
    "cluster": ClusterConfig,
    "tracking": TrackingConfig,
    "debug": DebugConfig,
}


def register_configs() -> None:
    """Store base_config (the root schema) and base_<group> for every group, once a process: storing converts
    each dataclass into an OmegaConf node again (~0.2 s), and compose() calls this every time."""
    cs = ConfigStore.instance()
    if "base_config.yaml" in cs.repo:
        return
    cs.store(name="base_config", node=SlimeConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
