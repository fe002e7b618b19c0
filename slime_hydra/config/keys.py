"""Unknown keys: refused with the nearest valid name, wherever they come from.

Hydra's structured configs reject a misspelt ``rollout.temprature=1`` (with a hint to add ``+``), but a key added
with ``+``/``++`` is silently accepted and then ignored. Two checks close both holes:

- ``check_overrides`` runs on the command line before Hydra composes, so a typo gets "did you mean" instead of
  Hydra's advice to append it;
- ``check_composed`` walks the composed config against the schema, catching keys that entered any other way.

Passthrough dicts (``rollout.sglang``, ``train.megatron``) accept any key here; config/passthrough.py checks them.
"""

import dataclasses
import typing
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, ListConfig

from slime_hydra.options import Problem, nearest
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.config.store import GROUP_SCHEMAS

_OPEN = object()
"""Marker for a Dict[str, Any] field: any key below it is allowed."""


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _resolve(annotation: Any) -> Any:
    """The dataclass, list-of-dataclass, open dict or leaf a field annotation stands for."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _resolve(args[0]) if len(args) == 1 else None
    if dataclasses.is_dataclass(annotation):
        return annotation
    if origin in (dict, typing.Dict):
        return _OPEN
    if origin in (list, typing.List):
        (item,) = typing.get_args(annotation)
        return ("list", _resolve(item))
    return None


def check_key(dotted: str) -> Optional[Problem]:
    """None when ``dotted`` names a key of the schema (or lies under a passthrough dict), else a Problem."""
    node: Any = SlimeConfig
    walked: list[str] = []
    for part in dotted.split("."):
        if node is _OPEN:
            return None
        if isinstance(node, tuple):  # a list of dataclasses: an index, then the item's fields
            if not part.isdigit():
                return Problem((dotted,), f"'{'.'.join(walked)}' is a list: index it with a number")
            node, walked = node[1], walked + [part]
            continue
        if not dataclasses.is_dataclass(node):
            return Problem((dotted,), f"'{'.'.join(walked)}' is a value, it has no key '{part}'")
        fields = _field_types(node)
        if part not in fields:
            where = ".".join(walked) or "the top level"
            hint = nearest(part, fields)
            prefix = ".".join(walked + [""])
            fix = f"did you mean '{prefix}{hint}'?" if hint else f"valid keys: {', '.join(sorted(fields))}"
            return Problem((dotted,), f"unknown key '{part}' in {node.__name__} ({where})", fix)
        node, walked = _resolve(fields[part]), walked + [part]
    return None


def check_overrides(overrides: Sequence[str]) -> list[Problem]:
    """Problems of command-line overrides (``key=value``, ``+key=value``, ``++key=value``, sweeps ``key=a,b``).

    Group selections (``model=qwen3_8b``) are left to Hydra, which lists the available options; ``hydra.*``
    keys are Hydra's own.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problems = []
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        key = ov.key_or_group
        if key.startswith("hydra") or ov.is_delete():
            continue
        if "." not in key and (key in GROUP_SCHEMAS or key in ("recipes", "sweeps", "tuning")):
            continue
        problem = check_key(key)
        if problem:
            problems.append(problem)
    return problems


def check_composed(cfg: DictConfig) -> list[Problem]:
    """Every key present in the composed config must exist in the schema."""
    problems: list[Problem] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig):
            for k in node.keys():
                dotted = f"{prefix}.{k}" if prefix else str(k)
                problem = check_key(dotted)
                if problem:
                    problems.append(problem)
                    continue
                if not (dotted.endswith(".sglang") or dotted.endswith(".megatron")):
                    walk(node._get_node(k), dotted)
        elif isinstance(node, ListConfig):
            for i in range(len(node)):
                walk(node._get_node(i), f"{prefix}.{i}")

    walk(cfg, "")
    return problems
