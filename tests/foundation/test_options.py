"""options.py: each field's domain is declared once and checked with one message shape; the implementing code
accepts exactly the choices the schema declares."""

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import pytest

from slime_hydra.options import (Choice, ConfigError, Problem, Range, choice, counts_hold, domain_of,
                                 domain_problems, non_negative, positive, within)


@dataclass
class Inner:
    k: int = positive(1)


@dataclass
class Demo:
    mode: str = choice("a", ("a", "b", "long_name"))
    n: int = positive(1)
    m: Optional[int] = positive(None)
    z: float = non_negative(0.0)
    p: float = within(0.5, 0.0, 1.0, low_open=True)
    inner: Inner = field(default_factory=Inner)
    items: List[Inner] = field(default_factory=list)

    def check(self, prefix: str) -> Iterator[Problem]:
        if self.mode == "b" and self.n > 1:
            yield Problem((f"{prefix}mode", f"{prefix}n"), "mode b takes n=1")


def texts(cfg) -> list[str]:
    return [str(p) for p in domain_problems(cfg)]


def test_valid_config_has_no_problem():
    assert texts(Demo()) == [] and counts_hold(Demo())


def test_each_domain_names_the_key_and_the_fix():
    cfg = Demo(mode="long_nam", n=0, m=-2, z=-1.0, p=0.0, inner=Inner(k=0), items=[Inner(), Inner(k=-1)])
    assert texts(cfg) == [
        "[mode] 'long_nam' is not one of a, b, long_name; did you mean mode=long_name?",
        "[n] must be positive, got 0; set n to a value > 0",
        "[m] must be positive or null, got -2; set m=null or a value > 0",
        "[z] must be >= 0, got -1.0; set z to a value >= 0",
        "[p] must be in (0, 1], got 0.0; set p to a value in (0, 1]",
        "[inner.k] must be positive, got 0; set inner.k to a value > 0",
        "[items.1.k] must be positive, got -1; set items.1.k to a value > 0",
    ]
    assert not counts_hold(cfg)


def test_far_choice_lists_all_and_null_is_always_allowed():
    assert texts(Demo(mode="zzz")) == ["[mode] 'zzz' is not one of a, b, long_name; choose one of: a, b, long_name"]
    assert texts(Demo(m=None)) == []


def test_schema_check_method_runs_with_its_prefix():
    assert texts(Demo(mode="b", n=2)) == ["[mode, n] mode b takes n=1"]


def test_ranges_in_words():
    assert Range(0, low_open=True).text == "positive"
    assert Range(1, low_open=True).text == "> 1"
    assert Range(0, 1).text == "in [0, 1]"
    assert Range(None, 5, high_open=True).text == "< 5"
    assert Range(-1).contains(-1) and not Range(-1).contains(-2)


def test_domain_of_and_config_error():
    assert domain_of(Demo, "mode") == Choice(("a", "b", "long_name"))
    with pytest.raises(KeyError):
        domain_of(Demo, "nope")
    error = ConfigError([Problem(("a",), "bad")])
    assert isinstance(error, ValueError) and error.exit_code == 2 and str(error) == "1 config problem:\n  - [a] bad"


def test_field_helpers_keep_plain_dataclass_defaults():
    assert [f.default for f in dataclasses.fields(Demo)][:5] == ["a", 1, None, 0.0, 0.5]
