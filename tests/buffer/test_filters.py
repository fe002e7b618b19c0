"""Dynamic filters: nonzero_std with float and dict rewards, custom filters by dotted path, result checking."""

import numpy as np
import pytest

from slime_hydra.buffer import NonzeroStd, Sample, apply_filter, get_filter


def group(*rewards) -> list[Sample]:
    return [Sample(index=i, reward=r, status="completed") for i, r in enumerate(rewards)]


def test_nonzero_std_keeps_mixed_groups_and_drops_uniform_ones():
    f = NonzeroStd()
    assert f(group(1.0, 0.0, 0.0, 0.0)) == (True, "zero_std")
    assert f(group(1.0, 1.0, 1.0, 1.0)) == (False, "zero_std")
    assert f(group(0.0, 0.0, 0.0, 0.0)) == (False, "zero_std")
    assert f(group(1.0)) == (False, "zero_std")  # one sample has no spread


def test_nonzero_std_reads_dict_rewards_through_reward_key():
    f = NonzeroStd(reward_key="score")
    assert f(group({"score": 1.0, "pred": "3"}, {"score": 0.0, "pred": "4"}))[0]
    assert not f(group({"score": 0.5, "pred": "3"}, {"score": 0.5, "pred": "4"}))[0]
    with pytest.raises(ValueError, match="reward.reward_key"):
        NonzeroStd()(group({"score": 1.0}, {"score": 0.0}))


def test_min_std_threshold():
    # rewards 0.0 and 0.1: population std 0.05
    assert NonzeroStd(min_std=0.04)(group(0.0, 0.1))[0] and not NonzeroStd(min_std=0.06)(group(0.0, 0.1))[0]


def test_get_filter_by_name_and_dotted_path():
    assert get_filter(None) is None
    f = get_filter("nonzero_std", reward_key="score")
    assert isinstance(f, NonzeroStd) and f.reward_key == "score"
    assert get_filter("operator.truth") is __import__("operator").truth
    with pytest.raises(ValueError, match="neither nonzero_std nor a dotted path"):
        get_filter("std")
    with pytest.raises(ValueError, match="algo.dynamic_filter='operator.nope' cannot be imported"):
        get_filter("operator.nope")


def test_apply_filter_normalises_results():
    def short_enough(g):
        return len(g) < 3

    assert apply_filter(short_enough, group(1, 2)) == (True, "short_enough")
    assert apply_filter(short_enough, group(1, 2, 3)) == (False, "short_enough")
    assert apply_filter(lambda g: (False, "too_long"), group(1)) == (False, "too_long")
    assert apply_filter(lambda g: np.float64(1.0) > 0, group(1)) == (True, "<lambda>")
    assert apply_filter(NonzeroStd(), group(1, 1)) == (False, "zero_std")
    with pytest.raises(TypeError, match="returned None; expected a bool or \\(bool, reason\\)"):
        apply_filter(lambda g: None, group(1))
    with pytest.raises(TypeError, match="returned 1"):
        apply_filter(lambda g: 1, group(1))
