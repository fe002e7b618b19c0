"""The config surface never grows unnoticed: the composed default's keys are pinned in default_keys.txt.

After adding a key on purpose, regenerate the file: UPDATE_SNAPSHOTS=1 python -m pytest tests/config/test_surface.py
"""

import dataclasses
import inspect
import os
import typing
from pathlib import Path

from omegaconf import OmegaConf

from slime_hydra.config import compose
from slime_hydra.config.schema import SlimeConfig

PINNED = Path(__file__).with_name("default_keys.txt")


def _keys(node, prefix=""):
    out = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _keys(value, dotted + ".")
        else:
            out.append(dotted)
    return out


def test_default_keys_are_pinned():
    cfg = OmegaConf.to_container(compose(), resolve=True)
    keys = sorted(_keys(cfg))
    if os.environ.get("UPDATE_SNAPSHOTS"):
        PINNED.write_text("\n".join(keys) + "\n")
    pinned = PINNED.read_text().split()
    added, removed = sorted(set(keys) - set(pinned)), sorted(set(pinned) - set(keys))
    assert not added and not removed, f"config surface changed: added {added}, removed {removed} (see docstring)"


def _undocumented_fields(schema) -> list[str]:
    """Fields with no docstring right under them, in schema and the schemas it nests (group slices excepted:
    a group's class documents itself)."""
    lines = inspect.getsource(schema).splitlines()
    hints = typing.get_type_hints(schema)
    missing = []
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            missing += _undocumented_fields(hint)
            continue
        idx = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{field.name}:"))
        if not lines[idx + 1].strip().startswith('"""'):
            missing.append(f"{schema.__name__}.{field.name}")
        for item in typing.get_args(hint):  # List[EvalDataConfig]
            if dataclasses.is_dataclass(item):
                missing += _undocumented_fields(item)
    return missing


def test_every_field_has_a_docstring():
    assert _undocumented_fields(SlimeConfig) == []
