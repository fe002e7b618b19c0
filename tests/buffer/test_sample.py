"""Sample: token layout properties, scalar reward, consistency check, JSON round trip."""

import json

import pytest

from slime_hydra.buffer import Sample, Status, group_weight_version


def scored(**kw) -> Sample:
    base = dict(index=5, group_index=1, prompt=[{"role": "user", "content": "1+2="}], label="3",
                metadata={"a": 1}, tokens=[7, 8, 9, 10, 11], response="3", response_length=2, loss_mask=[1, 1],
                rollout_log_probs=[-0.5, -0.25], reward={"score": 1.0, "acc": True}, weight_version=3,
                status=Status.COMPLETED)
    return Sample(**(base | kw))


def test_token_layout():
    s = scored()
    assert (s.prompt_length, s.prompt_tokens, s.response_tokens) == (3, [7, 8, 9], [10, 11])
    assert Sample().status is Status.PENDING and Sample().prompt_length == 0
    assert s.is_done and scored(status="truncated").is_done and not scored(status="aborted").is_done


def test_json_round_trip_keeps_every_field():
    s = scored()
    d = json.loads(json.dumps(s.to_dict()))
    assert d["status"] == "completed" and d["reward"] == {"score": 1.0, "acc": True}
    back = Sample.from_dict(d)
    assert back == s and back.status is Status.COMPLETED
    assert Sample.from_dict(Sample(prompt="x", reward=0.5).to_dict()) == Sample(prompt="x", reward=0.5)
    with pytest.raises(ValueError, match=r"not Sample fields: \['advantage'\]"):
        Sample.from_dict(d | {"advantage": 1.0})


def test_status_accepts_its_string_and_rejects_others():
    assert Sample(status="aborted").status is Status.ABORTED
    with pytest.raises(ValueError):
        Sample(status="done")


def test_scalar_reward():
    assert scored(reward=0.25).scalar_reward() == 0.25
    assert scored().scalar_reward("score") == 1.0
    with pytest.raises(ValueError, match=r"keys \['acc', 'score'\]; set reward.reward_key"):
        scored().scalar_reward()
    with pytest.raises(ValueError, match="sample 5 \\(group 1\\) has no reward yet"):
        scored(reward=None).scalar_reward()


def test_check_names_every_mismatch():
    scored().check()
    scored(rollout_log_probs=[]).check()  # engines may not return logprobs
    with pytest.raises(ValueError, match="loss_mask has 1 entries for response_length=2; rollout_log_probs has 3"):
        scored(loss_mask=[1], rollout_log_probs=[0.0, 0.0, 0.0]).check()
    with pytest.raises(ValueError, match="response_length=6 with 5 tokens"):
        scored(response_length=6, loss_mask=[1] * 6, rollout_log_probs=[]).check()


def test_group_weight_version_ignores_samples_without_response_tokens():
    group = [scored(weight_version=4), scored(weight_version=2), scored(weight_version=1, response_length=0)]
    assert group_weight_version(group) == 2
    assert group_weight_version([Sample(weight_version=0)]) is None
