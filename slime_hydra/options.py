"""A config option in one place: its default, its domain (choices or a range), and the Problem that names it.

Group schemas (``slime_hydra/<component>/config.py``) declare each field's domain where the field is written::

    LR_DECAY_STYLES = ("constant", "linear", "cosine")   # the tuple the implementing code imports too

    lr_decay_style: str = choice("constant", LR_DECAY_STYLES)
    \"\"\"constant | linear | cosine.\"\"\"
    backend: str = choice("fsdp", TRAIN_BACKEND_KINDS)  # a pluggable kind: its registry of records (train/kinds.py)
    num_gpus: int = positive(1)
    top_p: float = within(1.0, 0.0, 1.0, low_open=True)

Each helper returns ``dataclasses.field(default=..., metadata={"domain": ...})``: OmegaConf and Hydra read the
default and ignore the metadata, so a schema stays a plain structured config. ``domain_problems(cfg)`` walks every
field of a schema instance (nested schemas and lists of them included) and yields one ``Problem`` per value outside
its domain, each naming the dotted key and the fix. ``None`` is inside the domain of every field (an Optional
field's docstring says what null means: "derive it", "off", "all").

What a choice or a range cannot say about one group (top_k is -1 or >= 1; GSPO needs its loss aggregation) is a
``check(self, prefix)`` method beside the group's fields, yielding Problems; ``domain_problems`` calls it. Rules
that relate several groups live in ``config/rules.py``.

Nothing here imports the rest of slime_hydra: every layer may use it (docs/architecture.md).
"""

import ast
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import typing
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Problem:
    keys: tuple[str, ...]
    """The config keys involved, dotted (e.g. train.global_batch_samples)."""
    message: str
    """What is wrong, with the values involved."""
    fix: str = ""
    """A concrete override or edit that resolves it."""

    def __str__(self) -> str:
        text = f"[{', '.join(self.keys)}] {self.message}"
        return f"{text}; {self.fix}" if self.fix else text


class ConfigError(ValueError):
    """Raised before anything starts; lists every problem of the config."""

    exit_code = 2
    """What launch.py (and every command that validates a config) exits with on a config error."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{n} config problem{'s' if n != 1 else ''}:"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def nearest(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The candidate closest to ``name`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


# ---- domains ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """The value is one of ``choices``."""

    choices: Sequence[str] | Mapping[str, Any]
    """The valid values; a registry (a Mapping of name -> record) stays live: a kind registered later is a choice."""

    @property
    def names(self) -> tuple[str, ...]:
        """The valid values now, in order."""
        return tuple(self.choices)

    def __repr__(self) -> str:
        return f"Choice{self.names}"

    def problem(self, key: str, value: Any) -> Optional[Problem]:
        if value in self.choices:
            return None
        hint = nearest(str(value), self.names)
        fix = f"did you mean {key}={hint}?" if hint else f"choose one of: {', '.join(self.names)}"
        return Problem((key,), f"'{value}' is not one of {', '.join(self.names)}", fix)


@dataclass(frozen=True)
class Range:
    """The value lies between ``low`` and ``high`` (either may be None: unbounded on that side)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    """True: the value must be > low (else >= low)."""
    high_open: bool = False
    """True: the value must be < high (else <= high)."""

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def text(self) -> str:
        """The domain in words: "positive", ">= 0", "in (0, 1]" ..."""
        if self.high is None:
            if self.low == 0 and self.low_open:
                return "positive"
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                f"{')' if self.high_open else ']'}")

    def problem(self, key: str, value: Any, nullable: bool) -> Optional[Problem]:
        if self.contains(value):
            return None
        wanted = self.text
        if nullable:
            return Problem((key,), f"must be {wanted} or null, got {value}", f"set {key}=null or a value {_as_fix(wanted)}")
        return Problem((key,), f"must be {wanted}, got {value}", f"set {key} to a value {_as_fix(wanted)}")


def _num(x: float) -> str:
    return f"{x:g}"


def _as_fix(wanted: str) -> str:
    return "> 0" if wanted == "positive" else wanted


# ---- field helpers (what the schemas write) -----------------------------------------------------------------------
def choice(default: Optional[str], choices: Sequence[str] | Mapping[str, Any]) -> Any:
    """A string option whose value is one of ``choices``: the tuple the implementing code imports too, or the
    registry of a pluggable kind (name -> record; model/families.FAMILIES), read live."""
    return dataclasses.field(default=default, metadata={"domain": Choice(choices if isinstance(choices, Mapping)
                                                                         else tuple(choices))})


def within(default: Any, low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
           high_open: bool = False) -> Any:
    """A number in [low, high] (open ends with low_open / high_open; None: unbounded on that side)."""
    return dataclasses.field(default=default, metadata={"domain": Range(low, high, low_open, high_open)})


def positive(default: Any) -> Any:
    """A number > 0 (counts, sizes, rates, timeouts)."""
    return within(default, 0, low_open=True)


def non_negative(default: Any) -> Any:
    """A number >= 0 (0 usually means "off"; the field's docstring says)."""
    return within(default, 0)


def field_doc(schema: type, dotted: str) -> str:
    """The docstring written under field ``dotted`` (``train.lr``: through the nested schemas) of a schema."""
    *path, name = dotted.split(".")
    for part in path:
        schema = typing.get_type_hints(schema)[part]
    tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    body = tree.body[0].body
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            return " ".join(str(after.value.value).split())
    raise KeyError(f"{schema.__name__}.{name} has no docstring")


def domain_of(schema: type, name: str) -> Optional[Any]:
    """The Choice or Range declared on field ``name`` of a schema dataclass, or None."""
    for f in dataclasses.fields(schema):
        if f.name == name:
            return f.metadata.get("domain")
    raise KeyError(f"{schema.__name__} has no field {name!r}")


def domain_problems(cfg: Any, prefix: str = "") -> Iterator[Problem]:
    """Every value of ``cfg`` (a schema dataclass instance, walked recursively) outside its declared domain, then
    what each schema's ``check`` method finds."""
    for key, f, value in _leaves(cfg, prefix):
        domain = f.metadata.get("domain")
        if _non_finite(value):
            yield Problem((key,), f"is {value!r}: every number must be finite", f"set {key} to a finite number"
                          + (f" ({domain.text})" if isinstance(domain, Range) else ""))
            continue
        if domain is None or value is None:
            continue
        if isinstance(domain, Choice):
            problem = domain.problem(key, value)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            problem = Problem((key,), f"must be a number, got {value!r}")
        else:
            problem = domain.problem(key, value, nullable=type(None) in typing.get_args(f.type))
        if problem is not None:
            yield problem
    for schema, schema_prefix in _schemas(cfg, prefix):
        check = getattr(schema, "check", None)
        if check is not None:
            yield from check(schema_prefix)


def _non_finite(value: Any) -> bool:
    """A float (or a list / dict holding one) that is NaN or infinite: YAML's .nan / .inf parse as floats."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def counts_hold(cfg: Any) -> bool:
    """Every field declared positive or non-negative (counts, sizes: what the cross-group arithmetic divides by)
    holds a value in its range."""
    return all(value is None or not isinstance(value, (int, float)) or f.metadata["domain"].contains(value)
               for _, f, value in _leaves(cfg, "")
               if isinstance(f.metadata.get("domain"), Range) and f.metadata["domain"].low == 0)


def _schemas(cfg: Any, prefix: str) -> Iterator[tuple[Any, str]]:
    """(schema instance, its dotted prefix) for cfg and every schema nested in it, depth first."""
    yield cfg, prefix
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        items = [(value, f"{prefix}{f.name}.")] if dataclasses.is_dataclass(value) else (
            [(v, f"{prefix}{f.name}.{i}.") for i, v in enumerate(value) if dataclasses.is_dataclass(v)]
            if isinstance(value, list) else [])
        for item, item_prefix in items:
            yield from _schemas(item, item_prefix)


def _leaves(cfg: Any, prefix: str) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every field that is not itself a schema, in every nested schema."""
    for schema, schema_prefix in _schemas(cfg, prefix):
        for f in dataclasses.fields(schema):
            value = getattr(schema, f.name)
            if not dataclasses.is_dataclass(value) and not (isinstance(value, list) and value
                                                               and dataclasses.is_dataclass(value[0])):
                yield f"{schema_prefix}{f.name}", f, value


# ---- passthrough options ------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def snapshot(name: str) -> dict:
    """A pinned snapshot of a real program's options, ``slime_hydra/snapshots/<name>.json`` (``sglang_server_args``;
    regenerated by scripts/snapshot_passthrough.py): {source, version, options: {name: spec}}. It is the domain of
    a passthrough dict (``rollout.sglang``), so a login node without the package can refuse a typo."""
    return json.loads(resources.files("slime_hydra").joinpath("snapshots", f"{name}.json").read_text())


def passthrough_problems(section: str, options: Mapping[str, Any], snapshot_name: str,
                         owned: Mapping[str, str]) -> Iterator[Problem]:
    """Keys of the passthrough dict ``section`` that are no option of the snapshot (with the nearest name), or that
    the platform sets itself (``owned``: option -> the config key that owns it; two sources of truth refused)."""
    if not options:
        return
    known = snapshot(snapshot_name)
    names = known["options"]
    for key in options:
        dotted = f"{section}.{key}"
        if key in owned:
            yield Problem((dotted,), f"'{key}' is owned by the platform", f"use {owned[key]} instead")
        elif key not in names:
            hint = nearest(key, names)
            fix = f"did you mean {section}.{hint}?" if hint else "see the option list of " + known["source"]
            yield Problem((dotted,), f"'{key}' is not an option of {known['source']} {known['version']}", fix)
