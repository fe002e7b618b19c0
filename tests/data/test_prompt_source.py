"""PromptSource: reproducible per-epoch shuffles, batches across epoch ends, and an exact JSON-round-trip resume."""

import json

import pytest

from slime_hydra.data import PromptSource

RECORDS = list(range(10))  # any sequence works; ints make the order easy to read


def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch():
    a, b = PromptSource(RECORDS, 5, seed=3), PromptSource(RECORDS, 5, seed=3)
    epoch0 = a.take(10)
    assert sorted(epoch0) == RECORDS and epoch0 == b.take(10)
    epoch1 = a.take(10)
    assert sorted(epoch1) == RECORDS and epoch1 != epoch0
    assert a.order(0) == PromptSource(RECORDS, 5, seed=3).order(0) != PromptSource(RECORDS, 5, seed=4).order(0)
    assert PromptSource(RECORDS, 4, shuffle=False).take(12) == RECORDS + [0, 1]


def test_batch_straddling_an_epoch_end_fills_from_the_next_epoch():
    src = PromptSource(RECORDS, 4, seed=7)
    order0, order1 = src.order(0), src.order(1)
    batches = [src.next_batch() for _ in range(3)]
    assert batches[0] == order0[0:4] and batches[1] == order0[4:8]
    assert batches[2] == order0[8:10] + order1[0:2]  # 2 left in epoch 0, then 2 from epoch 1
    assert (src.epoch, src.offset, src.consumed) == (1, 2, 12)
    assert next(src) == order1[2:6]


def test_a_batch_larger_than_the_dataset_spans_epochs():
    src = PromptSource([0, 1, 2], 7, shuffle=False)
    assert src.next_batch() == [0, 1, 2, 0, 1, 2, 0] and (src.epoch, src.offset) == (2, 1)


@pytest.mark.parametrize("batch_prompts", [4, 7])
def test_resume_after_7_batches_gives_the_8th_batch(batch_prompts):
    # the 8th batch straddles an epoch end: prompts 28..31 cross 30 (4 per batch), 49..55 cross 50 (7 per batch)
    assert (7 * batch_prompts) // 10 != (8 * batch_prompts - 1) // 10
    uninterrupted = PromptSource(RECORDS, batch_prompts, seed=11)
    expected = [uninterrupted.next_batch() for _ in range(9)]

    first = PromptSource(RECORDS, batch_prompts, seed=11)
    for _ in range(7):
        first.next_batch()
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["epoch"] * 10 + saved["offset"] == 7 * batch_prompts
    resumed = PromptSource(RECORDS, batch_prompts, seed=11)
    resumed.load_state_dict(saved)
    assert resumed.next_batch() == expected[7] and resumed.next_batch() == expected[8]


def test_resume_exactly_at_an_epoch_boundary():
    first = PromptSource(RECORDS, 5, seed=2)
    first.take(20)
    assert first.state_dict()["epoch"] == 2 and first.state_dict()["offset"] == 0
    resumed = PromptSource(RECORDS, 5, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.next_batch() == first.next_batch() == resumed.order(2)[:5]


def test_resume_checks_the_dataset_and_seed_but_not_the_batch_size():
    src = PromptSource(RECORDS, 4, seed=1)
    src.take(13)
    state = src.state_dict()
    other = PromptSource(RECORDS, 6, seed=1)
    other.load_state_dict(state)
    assert other.take(2) == src.take(2)
    with pytest.raises(ValueError, match="num_records: saved 10, now 9"):
        PromptSource(RECORDS[:9], 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        PromptSource(RECORDS, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="offset=10"):
        PromptSource(RECORDS, 4, seed=1).load_state_dict(state | {"offset": 10})


def test_invalid_arguments():
    with pytest.raises(ValueError, match="at least one record"):
        PromptSource([], 4)
    with pytest.raises(ValueError, match="batch_prompts=0"):
        PromptSource(RECORDS, 0)
