"""Config: schema (one dataclass per group), composition, pre-flight validation, derived values.

    compose(overrides) -> DictConfig           Hydra composition of conf/ + recipes/ + sweeps/ (tests, tools)
    to_config(dictconfig) -> SlimeConfig       unknown/missing keys checked, then OmegaConf.to_object once
    load_run_config(run_dir) -> SlimeConfig    what a run ran with (its resolved.yaml)
    validate(cfg) -> Derived                   every cross-key rule; raises ConfigError listing all problems
"""

import os
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from slime_hydra.config.derive import Derived, derive
from slime_hydra.options import ConfigError, Problem
from slime_hydra.config.keys import check_composed, check_overrides
from slime_hydra.config.rules import collect_problems, validate
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.config.store import register_configs

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout holding conf/, recipes/ and sweeps/ (launch.py's directory)."""

__all__ = [
    "ConfigError", "Derived", "Problem", "SlimeConfig", "PROJECT_ROOT", "check_overrides", "collect_problems",
    "compose", "derive", "load_run_config", "register_configs", "to_config", "validate",
]


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the primary config with command-line style overrides, exactly as launch.py does (no run)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    problems = check_overrides(overrides)
    if problems:
        raise ConfigError(problems)
    os.environ.setdefault("SLIME_HYDRA_ROOT", str(PROJECT_ROOT))
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def load_run_config(run_dir: str | Path) -> SlimeConfig:
    """The typed config a run ran with, from its ``resolved.yaml`` (launch/run_dir.py writes it)."""
    path = Path(run_dir) / "resolved.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no resolved.yaml)")
    return to_config(OmegaConf.merge(OmegaConf.structured(SlimeConfig), OmegaConf.load(path)))


def to_config(cfg: DictConfig) -> SlimeConfig:
    """The typed config, after refusing keys the schema does not have and values left '???'."""
    problems = check_composed(cfg)
    if problems:
        raise ConfigError(problems)
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    return OmegaConf.to_object(plain)
