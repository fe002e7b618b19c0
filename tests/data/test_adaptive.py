"""AdaptiveSampler: levels follow the pass rate within the band and the bounds; its state resumes exactly."""

import json

import pytest

from slime_hydra.data.adaptive import AdaptiveSampler, GroupResult
from slime_hydra.data.config import AdaptiveConfig


def sampler(tasks=("arithmetic",), **options) -> AdaptiveSampler:
    cfg = AdaptiveConfig(enabled=True, tasks=list(tasks), **{"band_low": 0.3, "band_high": 0.7, "window_groups": 4,
                                                           **options})
    return AdaptiveSampler(cfg, tasks[0], seed=11, make_records=lambda rows: rows)


def feed(s: AdaptiveSampler, rate: float, groups: int = 4, task: str = "arithmetic") -> dict:
    """One batch of ``groups`` groups of the task's current level, each with pass rate ``rate``."""
    return s.update([GroupResult(task, s.level(task), rate)] * groups)


def test_level_goes_up_above_the_band_and_down_below_it_within_bounds():
    s = sampler(start_level=3, max_level=5)
    assert [r["metadata"]["level"] for r in s.take(3)] == [3, 3, 3]
    levels = []
    for rate in [0.9, 0.9, 0.9, 0.9, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]:
        levels.append(feed(s, rate)["env/arithmetic/level"])
    #           up  up   (5 = max)   inside the band   down ...                  (1 = min)
    assert levels == [4, 5, 5, 5, 5, 5, 4, 3, 2, 1, 1, 1]
    assert s.take(2)[0]["metadata"]["level"] == 1


def test_the_level_moves_only_on_a_full_window_of_its_own_groups():
    s = sampler(start_level=2)
    assert feed(s, 1.0, groups=3)["env/arithmetic/level"] == 2          # 3 of 4: not judged yet
    s.update([GroupResult("arithmetic", 1, 0.0)] * 10)                   # drawn at an older level: not counted
    assert s.level("arithmetic") == 2
    metrics = feed(s, 1.0, groups=1)                                     # the 4th: mean 1.0 > 0.7
    assert metrics["env/arithmetic/level"] == 3 and "env/arithmetic/window_pass_rate" not in metrics
    # a mean inside the band slides the window: the oldest rate leaves as the next one comes
    m = s.update([GroupResult("arithmetic", 3, r) for r in (0.2, 0.9, 0.2, 0.9)])
    assert m["env/arithmetic/level"] == 3 and m["env/arithmetic/window_pass_rate"] == pytest.approx(0.55)
    assert m["env/arithmetic/pass_rate"] == pytest.approx(0.55) and m["env/arithmetic/groups"] == 4
    assert s.places["arithmetic"].window == [0.2, 0.9, 0.2, 0.9]
    assert feed(s, 0.9, groups=1)["env/arithmetic/level"] == 4            # [0.9, 0.2, 0.9, 0.9]: 0.725 > 0.7
    assert s.places["arithmetic"].window == []
    assert m["env/arithmetic/level_3/pass_rate"] == pytest.approx(0.55)


def test_levels_stay_within_each_tasks_own_range():
    s = sampler(tasks=("countdown", "sorting"), start_level=9)            # countdown has 5 levels, sorting 10
    assert (s.level("countdown"), s.level("sorting")) == (5, 9)
    for _ in range(5):
        feed(s, 1.0, task="countdown")
        feed(s, 1.0, task="sorting")
    assert (s.level("countdown"), s.level("sorting")) == (5, 10)


def test_tasks_are_mixed_round_robin_each_at_its_level():
    s = sampler(tasks=("arithmetic", "sorting"), start_level=1)
    feed(s, 1.0, task="sorting")
    rows = s.take(4)
    assert [(r["metadata"]["task"], r["metadata"]["level"]) for r in rows] == [
        ("arithmetic", 1), ("sorting", 2), ("arithmetic", 1), ("sorting", 2)]


def test_a_restored_sampler_draws_exactly_the_prompts_of_the_uninterrupted_one():
    a = sampler(start_level=2)
    a.take(8)
    feed(a, 0.9, groups=2)                                               # half a window, kept in the state
    state = json.loads(json.dumps(a.state_dict()))                       # as rollout.json stores it
    b = sampler(start_level=2)
    b.load_state_dict(state)
    for rate in [0.9, 0.9, 0.1, 0.5]:
        assert b.take(6) == a.take(6)
        assert feed(b, rate, groups=3) == feed(a, rate, groups=3)
    assert b.state_dict() == a.state_dict() and a.drawn == 32
    fresh = sampler(start_level=2)
    fresh.take(8)
    assert fresh.take(6) != sampler(start_level=2).take(6)               # the counter matters


def test_state_checks_what_it_restores():
    with pytest.raises(ValueError, match="seed"):
        s = sampler()
        s.seed = 12
        s.load_state_dict(sampler().state_dict())
    with pytest.raises(ValueError, match="adaptive.enabled=true"):
        sampler().load_state_dict({"epoch": 0, "offset": 0, "seed": 11, "shuffle": True, "num_records": 5})
    from slime_hydra.data.source import PromptSource
    with pytest.raises(ValueError, match="adaptive.enabled=false"):
        PromptSource([1, 2, 3], 2, seed=11).load_state_dict(sampler().state_dict())


def test_dropped_prompts_are_an_error_naming_the_fix():
    s = AdaptiveSampler(AdaptiveConfig(enabled=True), "sorting", 0, make_records=lambda rows: rows[1:])
    with pytest.raises(ValueError, match="data.max_prompt_tokens"):
        s.take(2)
