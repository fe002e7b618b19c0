"""Compose + check + validate, as launch.py does, returning the typed config or the ConfigError."""

from slime_hydra.config import ConfigError, compose, to_config, validate


def load(*overrides: str):
    """(SlimeConfig, Derived) for a valid config; raises ConfigError otherwise."""
    cfg = to_config(compose(overrides))
    return cfg, validate(cfg)


def problems(*overrides: str) -> ConfigError:
    """The ConfigError a config must raise (fails the test if it is valid)."""
    try:
        load(*overrides)
    except ConfigError as error:
        return error
    raise AssertionError(f"config {overrides} was accepted but must be refused")
