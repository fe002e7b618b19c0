"""RolloutBuffer: filtering and counts, over-sampling rounds, fallback top-up, partial-rollout recycling,
staleness, and a JSON round trip of its state."""

import json
from types import SimpleNamespace

import pytest

from slime_hydra.buffer import NonzeroStd, Request, RolloutBuffer, Sample, Status, Verdict

N = 4  # samples per prompt in these tests
MIXED, UNIFORM = (1.0, 0.0, 0.0, 1.0), (1.0, 1.0, 1.0, 1.0)


def records(n, start=0):
    return [SimpleNamespace(prompt=f"{i}+1=", token_ids=[20 + i % 10, 16, 21, 34], label=str(i + 1),
                            metadata={"i": i}, tools=None) for i in range(start, start + n)]


def finish(group, rewards=MIXED, version=0, status="completed"):
    """What generation + scoring does to a group: 2 response tokens per sample, a reward, a status."""
    for s, r in zip(group, rewards):
        s.tokens = s.tokens + [22, 1]
        s.response, s.response_length, s.loss_mask, s.rollout_log_probs = "2", 2, [1, 1], [-0.1, -0.2]
        s.reward, s.weight_version, s.status = r, version, Status(status)
    return group


def make(n_groups, buffer, **kw):
    return [finish(g, **kw) for g in buffer.new_groups(records(n_groups))]


def test_new_groups_number_samples_and_copy_the_prompt():
    buf = RolloutBuffer(N)
    first = buf.new_groups(records(2))
    tools = [{"type": "function"}]
    second = buf.new_groups([SimpleNamespace(prompt="x", token_ids=[5], label=None, metadata={}, tools=tools)])
    assert [s.index for s in first[1]] == [4, 5, 6, 7] and {s.group_index for s in first[1]} == {1}
    assert second[0][0].group_index == 2 and second[0][0].index == 8 and second[0][0].metadata["tools"] == tools
    s = first[0][0]
    assert (s.prompt, s.tokens, s.label, s.status, s.response_length) == ("0+1=", [20, 16, 21, 34], "1",
                                                                           Status.PENDING, 0)
    s.metadata["i"] = 99
    assert first[0][1].metadata == {"i": 0}  # samples do not share mutable state


def test_filter_counts_by_reason_and_first_rejecting_filter_wins():
    def no_long(group):
        return all(s.response_length < 2 for s in group), "too_long"

    buf = RolloutBuffer(N, filters=[NonzeroStd(), no_long])
    verdicts = [buf.add_group(g) for g in make(6, buf, rewards=MIXED) + make(4, buf, rewards=UNIFORM)]
    assert verdicts.count(Verdict.FILTERED) == 10  # mixed groups pass nonzero_std, then fail no_long
    assert buf.totals == {"finished": 10, "filtered/too_long": 6, "filtered/zero_std": 4}

    buf = RolloutBuffer(N, filters=[NonzeroStd()])
    verdicts = [buf.add_group(g) for g in make(6, buf, rewards=MIXED) + make(4, buf, rewards=UNIFORM)]
    assert verdicts == [Verdict.KEPT] * 6 + [Verdict.FILTERED] * 4
    assert (buf.num_kept, buf.num_reserve, buf.totals["kept"], buf.totals["filtered/zero_std"]) == (6, 4, 6, 4)


def test_over_sampling_round_tells_when_enough_passed_and_recycles_the_rest():
    buf = RolloutBuffer(N, filters=[NonzeroStd()])
    req = buf.request(batch_prompts=4, over_sampling_batch_prompts=6)
    assert (req.resume, req.new_prompts, req.round) == ([], 6, 1)
    groups = buf.new_groups(records(req.new_prompts))
    enough_after = None
    for k, (g, rewards) in enumerate(zip(groups[:5], [MIXED, UNIFORM, MIXED, MIXED, MIXED]), start=1):
        buf.add_group(finish(g, rewards))
        if enough_after is None and buf.enough(4):
            enough_after = k
    assert enough_after == 5  # 4 passed among the first 5 finished groups
    aborted = groups[5]
    aborted[0].tokens, aborted[0].response_length, aborted[0].loss_mask = aborted[0].tokens + [22], 1, [1]
    aborted[0].weight_version = 0
    for s in aborted:
        s.status = Status.ABORTED
    assert buf.add_group(aborted) is Verdict.RECYCLED
    assert buf.request(4, 6) is None

    batch = buf.take_batch(4)
    assert [g[0].group_index for g in batch.groups] == [0, 2, 3, 4] and len(batch.samples) == 16
    assert (batch.topped_up, batch.rounds) == (0, 1)
    assert batch.counts == {"rounds": 1, "finished": 5, "kept": 4, "filtered/zero_std": 1, "recycled": 1,
                            "trained": 4}
    assert buf.num_reserve == 0  # the filtered group is not carried to the next step

    nxt = buf.request(4, 6)  # the recycled group comes first, with its partial response
    assert nxt.round == 1 and nxt.new_prompts == 5 and [g[0].group_index for g in nxt.resume] == [5]
    resumed = nxt.resume[0][0]
    assert resumed.status is Status.PENDING and resumed.response_length == 1 and resumed.tokens[-1] == 22


def test_later_rounds_ask_for_the_deficit_scaled_by_the_over_sampling_ratio():
    buf = RolloutBuffer(N, filters=[NonzeroStd()], max_attempts=5)
    assert buf.request(8, 12).new_prompts == 12
    for g in make(5, buf):
        buf.add_group(g)
    req = buf.request(8, 12)
    assert (req.round, req.new_prompts) == (2, 5)  # 3 missing x 12/8 = 4.5 -> 5
    assert buf.request(8).new_prompts == 3  # no over-sampling: exactly the deficit
    with pytest.raises(ValueError, match="batch_prompts <= over_sampling_batch_prompts, got 8 and 6"):
        buf.request(8, 6)


def test_fallback_tops_up_with_filtered_groups_after_max_attempts():
    buf = RolloutBuffer(N, filters=[NonzeroStd()], max_attempts=2)
    assert buf.request(4).new_prompts == 4
    for g, r in zip(buf.new_groups(records(4)), [MIXED, UNIFORM, UNIFORM, UNIFORM]):
        buf.add_group(finish(g, r))
    assert buf.request(4).new_prompts == 3
    for g, r in zip(buf.new_groups(records(3)), [UNIFORM, MIXED, UNIFORM]):
        buf.add_group(finish(g, r))
    assert (buf.num_kept, buf.num_reserve) == (2, 5)
    assert buf.request(4) is None  # 2 rounds done and 2 kept + 5 filtered can fill 4

    batch = buf.take_batch(4)
    assert [g[0].group_index for g in batch.groups] == [0, 5, 1, 2]  # kept first, then the oldest filtered
    assert (batch.topped_up, batch.rounds, batch.counts["topped_up"], batch.counts["filtered/zero_std"]) == (2, 2,
                                                                                                             2, 5)
    assert (buf.num_kept, buf.num_reserve, buf.totals["trained"]) == (0, 0, 4)


def test_rounds_go_on_past_max_attempts_only_while_they_make_progress():
    buf = RolloutBuffer(N, filters=[NonzeroStd()], max_attempts=1)
    buf.request(4)
    for g in make(2, buf, rewards=UNIFORM):
        buf.add_group(g)
    assert buf.request(4).new_prompts == 4  # 0 kept + 2 filtered cannot fill 4: another round
    for g in make(4, buf, status="failed"):
        assert buf.add_group(g) is Verdict.DISCARDED
    with pytest.raises(RuntimeError, match="round 2 finished no group .* 0 kept \\+ 2 filtered of 4"):
        buf.request(4)
    with pytest.raises(RuntimeError, match="cannot fill a batch of 4 groups: 0 kept \\+ 2 filtered"):
        buf.take_batch(4)
    assert (buf.num_reserve, buf.totals["failed"]) == (2, 4)  # the failed take_batch changed nothing


def test_extra_kept_groups_wait_for_the_next_batch():
    buf = RolloutBuffer(N)
    for g in make(6, buf):
        buf.add_group(g)
    assert [g[0].group_index for g in buf.take_batch(4).groups] == [0, 1, 2, 3]
    assert buf.num_kept == 2 and buf.request(4).new_prompts == 2


def test_aborted_groups_keep_partial_work_and_are_resumed_first_partial_first():
    buf = RolloutBuffer(N)
    a, b = buf.new_groups(records(2))
    finish(a)
    a[2].status, a[3].status = Status.ABORTED, Status.ABORTED
    a[3].tokens, a[3].response_length, a[3].loss_mask = a[3].tokens[:-1], 1, [1]
    # b (never started) comes back first, a (with partial responses) is still handed out before it
    assert buf.add_group(b) is Verdict.RECYCLED and buf.add_group(a) is Verdict.RECYCLED
    assert [s.status for s in a] == [Status.COMPLETED, Status.COMPLETED, Status.PENDING, Status.PENDING]
    assert (a[0].response_length, a[3].response_length, a[3].tokens[-1]) == (2, 1, 22)
    req = buf.request(1, 1)
    assert req.resume == [a] and req.new_prompts == 0 and buf.num_pending == 1
    assert buf.request(1, 3).resume == [b]  # then b, then fresh prompts
    assert buf.totals["recycled"] == 2

    off = RolloutBuffer(N, recycle_aborted=False)
    g = make(1, off, status="aborted")[0]
    assert off.add_group(g) is Verdict.DISCARDED and off.num_pending == 0
    assert off.totals == {"aborted_discarded": 1}


def test_group_with_a_failed_sample_is_dropped():
    buf = RolloutBuffer(N)
    g = make(1, buf)[0]
    g[1].status = Status.FAILED
    g[2].status = Status.ABORTED
    assert buf.add_group(g) is Verdict.DISCARDED and buf.totals == {"failed": 1}


def test_staleness_bound_drops_old_groups_held_and_arriving():
    buf = RolloutBuffer(N, filters=[NonzeroStd()], max_staleness=1)
    buf.set_weight_version(4)  # groups of version >= 3 are fresh
    v3, v4, v2 = make(1, buf, version=3)[0], make(1, buf, version=4)[0], make(1, buf, version=2)[0]
    mixed = make(1, buf, version=4)[0]
    mixed[2].weight_version = 3  # a resumed sample whose first token came from version 3
    uniform3 = make(1, buf, version=3, rewards=UNIFORM)[0]
    assert [buf.add_group(g) for g in (v3, v4, v2, mixed, uniform3)] == [Verdict.KEPT, Verdict.KEPT, Verdict.STALE,
                                                                          Verdict.KEPT, Verdict.FILTERED]
    partial3, untouched = buf.new_groups(records(2))
    partial3[0].tokens, partial3[0].response_length, partial3[0].loss_mask = partial3[0].tokens + [7], 1, [1]
    partial3[0].weight_version, partial3[0].status = 3, Status.ABORTED
    buf.add_group(partial3)
    buf.add_group(untouched)  # no response tokens yet: never stale
    assert (buf.num_kept, buf.num_reserve, buf.num_pending, buf.totals["stale"]) == (3, 1, 2, 1)

    assert buf.set_weight_version(5) == 4  # v3, mixed (min 3), uniform3 and partial3 are older than 5 - 1
    assert (buf.num_kept, buf.num_reserve, buf.num_pending) == (1, 0, 1)
    batch = buf.take_batch(1)
    assert batch.groups == [v4] and batch.counts["stale"] == 5
    assert buf.request(1).resume == [untouched]
    with pytest.raises(ValueError, match="weight version went back from 5 to 4"):
        buf.set_weight_version(4)


def test_no_staleness_bound_keeps_everything():
    buf = RolloutBuffer(N, max_staleness=None)
    buf.add_group(make(1, buf, version=0)[0])
    assert buf.set_weight_version(100) == 0 and buf.num_kept == 1


def test_state_round_trips_through_json_mid_step():
    def build():
        buf = RolloutBuffer(N, filters=[NonzeroStd()], max_attempts=2, max_staleness=2)
        buf.set_weight_version(3)
        buf.request(3, 5)
        groups = buf.new_groups(records(5))
        for g, r in zip(groups[:3], [MIXED, UNIFORM, MIXED]):
            buf.add_group(finish(g, r, version=3))
        for g in groups[3:]:
            for s in g:
                s.status = Status.ABORTED
            buf.add_group(g)
        return buf

    original = build()
    state = json.loads(json.dumps(original.state_dict()))
    restored = RolloutBuffer(N, filters=[NonzeroStd()], max_attempts=2, max_staleness=2)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert (restored.num_kept, restored.num_reserve, restored.num_pending, restored.weight_version) == (2, 1, 2, 3)

    for buf in (original, restored):  # both continue identically
        req = buf.request(3, 5)  # 1 group missing x 5/3 -> 2 groups: the 2 recycled ones
        assert isinstance(req, Request) and (req.round, req.new_prompts, len(req.resume)) == (2, 0, 2)
        assert [g[0].group_index for g in buf.new_groups(records(1))] == [5]  # the group counter was restored
        for g in req.resume:
            buf.add_group(finish(g, version=3))
    a, b = original.take_batch(3), restored.take_batch(3)
    assert [[s.to_dict() for s in g] for g in a.groups] == [[s.to_dict() for s in g] for g in b.groups]
    assert a.counts == b.counts and a.counts["rounds"] == 2 and original.totals == restored.totals

    with pytest.raises(ValueError, match="groups of 4 samples, this one expects 8"):
        RolloutBuffer(8).load_state_dict(state)


def test_group_shape_is_checked():
    buf = RolloutBuffer(N)
    g = make(2, buf)
    with pytest.raises(ValueError, match="a group has 3 samples, expected n_samples_per_prompt=4"):
        buf.add_group(g[0][:3])
    with pytest.raises(ValueError, match=r"share group_index, got \[0, 1\]"):
        buf.add_group(g[0][:2] + g[1][:2])
    with pytest.raises(ValueError, match="max_staleness=-1"):
        RolloutBuffer(N, max_staleness=-1)
    assert isinstance(g[0][0], Sample)
