"""The config space, fuzzed (hypothesis): any combination of settings drawn from the schema and the groups is either
valid, derives its values and prints its plan, or is refused with Problems that name keys. Never a traceback.

Two levels. Through Hydra (150 examples: composing costs ~0.3 s): command-line overrides whose values are drawn
per field from its domain's edges, inside and outside (options.py), from other types and null, hostile values
(non-finite, huge, negative, empty, unicode: HOSTILE), and group options (plus misspelt ones). On the schema
(3,000 examples, milliseconds each): every group option composed once, then several fields set to well-typed values
around their domains' edges (and NaN, infinities, 1e308, 10**18, empty and unicode strings), straight into the
dataclasses: the rules' arithmetic (divisions by counts, by dp, by heads) meets every combination.
"""

import dataclasses
import io
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from slime_hydra.config import PROJECT_ROOT, ConfigError, check_overrides, collect_problems, register_configs, to_config
from slime_hydra.config.hydra_errors import as_problems
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.config.store import GROUP_SCHEMAS
from slime_hydra.options import Choice, Range

PASSTHROUGH = {"rollout.sglang", "train.megatron"}
OPTIONS = {group: sorted(p.stem for p in (PROJECT_ROOT / "conf" / group).glob("*.yaml")) for group in GROUP_SCHEMAS}


def _leaves(schema: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, typing.Any]]:
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(kind):
            out += _leaves(kind, f"{key}.")
        elif key not in PASSTHROUGH and typing.get_origin(kind) not in (list, dict, typing.List, typing.Dict):
            out.append((key, f, kind))
    return out


LEAVES = _leaves(SlimeConfig)


HOSTILE = ["nan", "inf", "-inf", "1e308", "-1e308", "99999999999999999999", "-99999999999999999999", "''",
           "'ünï漢字'", "'" + "x" * 300 + "'", "'../../etc'", "' '"]
"""Override values nobody should type: non-finite, huge, negative, empty, unicode, long, a path escape, blank."""


def _values(f: dataclasses.Field, kind) -> st.SearchStrategy:
    base = [x for x in typing.get_args(kind) if x is not type(None)] or [kind]
    domain = f.metadata.get("domain")
    edge: list = ["null", "abc", "-1", "0", "1", "3", "1000000", "0.5", "true", *HOSTILE]
    if isinstance(domain, Choice):
        edge += list(domain.names) + [c + "x" for c in domain.names[:2]]
    if isinstance(domain, Range):
        for bound in (domain.low, domain.high):
            if bound is not None:
                edge += [repr(bound), repr(bound - 1), repr(bound + 1)]
    if base[0] is int:
        return st.one_of(st.sampled_from(edge), st.integers(-5, 300).map(str))
    if base[0] is float:
        return st.one_of(st.sampled_from(edge), st.floats(-2, 2, allow_nan=False).map(lambda x: f"{x:.3g}"))
    return st.sampled_from(edge)


field_override = st.sampled_from(LEAVES).flatmap(
    lambda leaf: _values(leaf[1], leaf[2]).map(lambda v, key=leaf[0]: f"{key}={v}"))
group_override = st.sampled_from(sorted(OPTIONS)).flatmap(
    lambda g: st.sampled_from(OPTIONS[g] + [OPTIONS[g][0] + "x"]).map(lambda o, g=g: f"{g}={o}"))
overrides = st.lists(st.one_of(group_override, field_override, field_override), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def composer():
    import os

    from hydra import compose, initialize_config_dir

    os.environ.setdefault("SLIME_HYDRA_ROOT", str(PROJECT_ROOT))
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base=None):
        yield compose


def outcome(compose, ovs: list[str]) -> str:
    """"valid" (derived values and the plan printed), or "refused" (Problems naming keys); anything else raises."""
    from slime_hydra.launch.plan import print_plan

    try:
        problems = check_overrides(ovs)
        if not problems:
            cfg = to_config(compose("config", overrides=ovs))
            problems, derived = collect_problems(cfg)
    except ConfigError as error:
        problems = error.problems
    except Exception as error:  # Hydra's own errors must become Problems
        problems = as_problems(error, ovs)
        if problems is None:
            raise
    if problems:
        assert all(p.keys and all(p.keys) for p in problems), problems
        return "refused"
    print_plan(cfg, derived, PROJECT_ROOT / "runs" / "fuzz", Console(file=io.StringIO()))
    return "valid"


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides)
def test_any_override_combination_is_valid_or_refused_by_key(composer, ovs):
    assert outcome(composer, ovs) in ("valid", "refused")


def _typed_values(f: dataclasses.Field, kind) -> list:
    """Well-typed values around a field's domain: its edges and a step outside, small counts, null if Optional."""
    base = [x for x in typing.get_args(kind) if x is not type(None)] or [kind]
    domain = f.metadata.get("domain")
    values: list = [None] if type(None) in typing.get_args(kind) else []
    if isinstance(domain, Choice):
        return values + list(domain.names) + ["nonsense"]
    if base[0] is bool:
        return [True, False]
    if base[0] in (int, float):
        cast = base[0]
        edges = [0, 1, 2, 3, 4, 7, 8, 64, -1, -(10 ** 18), 10 ** 18]
        if isinstance(domain, Range):
            edges += [b + d for b in (domain.low, domain.high) if b is not None for d in (-1, 0, 1)]
        hostile = [float("nan"), float("inf"), float("-inf"), 1e308, -1e-308] if cast is float else []
        return values + [cast(v) for v in edges] + hostile
    if base[0] is str:
        return values + ["", " ", "ünï漢字", "x" * 300, "../../etc", "a.b.c"]
    return values


TYPED = [(key, _typed_values(f, kind)) for key, f, kind in LEAVES]
TYPED = [(key, vals) for key, vals in TYPED if vals]
BASES = [[f"{g}={o}"] for g in sorted(OPTIONS) for o in OPTIONS[g] if not o.startswith("base_")]


@pytest.fixture(scope="module")
def bases(composer):
    """Each group option composed once (with what it needs to be valid on its own), as SlimeConfig."""
    from tests.config.test_compose import NEEDS

    out = []
    for (ov,) in BASES:
        group, option = ov.split("=")
        extra = () if (group, option) == ("model", "tiny") else NEEDS.get((group, "*"), ()) + NEEDS.get((group, option), ())
        out.append(to_config(composer("config", overrides=[ov, *extra])))
    return out


FILESYSTEM = {"model.path", "data.path", "output_dir", "debug.rollout_path", "resume"}
"""Paths the schema-level fuzz leaves alone (config/files.py reads them at launch; the Hydra-level fuzz sets them)."""
settings_strategy = st.lists(st.sampled_from(range(len(TYPED))).flatmap(
    lambda i: st.sampled_from(TYPED[i][1]).map(lambda v, i=i: (TYPED[i][0], v))), min_size=1, max_size=8)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, len(BASES) - 1), settings_strategy)
def test_any_schema_setting_is_valid_or_refused_by_key(bases, base, assignments):
    import copy
    import operator

    from slime_hydra.launch.plan import print_plan

    cfg = copy.deepcopy(bases[base])
    assignments = [(key, value) for key, value in assignments if key not in FILESYSTEM]
    for key, value in assignments:
        *path, name = key.split(".")
        setattr(operator.attrgetter(".".join(path))(cfg) if path else cfg, name, value)
    problems, derived = collect_problems(cfg)
    if problems:
        assert all(p.keys and all(p.keys) for p in problems), problems
    else:
        print_plan(cfg, derived, PROJECT_ROOT / "runs" / "fuzz", Console(file=io.StringIO()))


def test_the_fuzzer_reaches_both_outcomes(composer):
    assert outcome(composer, ["rollout.temperature=0.7"]) == "valid"
    assert outcome(composer, ["rollout.temperature=abc"]) == "refused"
