"""The built-in addition task: sizes, disjoint splits, determinism, and the exact-match score."""

import pytest

from slime_hydra.data.tasks import get_task


def test_splits_are_disjoint_and_complete():
    task = get_task("addition")
    train, held = task.rows("train", seed=1), task.rows("eval", seed=1)
    assert (len(train), len(held)) == (9000, 1000)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(int(r["label"]) == r["metadata"]["a"] + r["metadata"]["b"] for r in train + held)
    assert task.rows("train", seed=1) == train and task.rows("train", seed=2) != train  # seeded shuffles


def test_sft_rows_come_from_the_train_split_only():
    task = get_task("addition")
    held = {r["prompt"] for r in task.rows("eval")}
    sft = task.sft_rows(500, seed=3)
    assert len(sft) == 500 and not {r["prompt"] for r in sft} & held
    assert all(r["response"] == str(eval(r["prompt"][:-1])) for r in sft)


@pytest.mark.parametrize("response,label,expected", [("46", "46", 1.0), (" 46\n", "46", 1.0), ("47", "46", 0.0),
                                                     ("046", "46", 0.0), ("", "46", 0.0), ("4 6", "46", 0.0)])
def test_score(response, label, expected):
    assert get_task("addition").score(response, label) == expected


def test_unknown_task_names_the_key():
    with pytest.raises(ValueError, match="data.task='multiplication'"):
        get_task("multiplication")
