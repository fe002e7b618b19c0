"""A reward that returns a dict has its other numeric entries logged as rollout/reward/<key> (issue 46 item 4)."""

from slime_hydra.buffer.sample import Sample
from slime_hydra.rollout.manager import reward_extras


def test_the_other_entries_of_dict_rewards_are_averaged_over_the_samples_that_have_them():
    rewards = [{"score": 1.0, "format": 0.5, "ok": True, "note": "x"}, {"score": 0.0, "format": 1.0},
               {"score": 0.0, "format": float("nan"), "length_penalty": -0.25}, 0.5]
    samples = [Sample(index=i, group_index=0, prompt="p", reward=r) for i, r in enumerate(rewards)]
    assert reward_extras(samples, "score") == {"rollout/reward/format": 0.75, "rollout/reward/length_penalty": -0.25,
                                               "rollout/reward/ok": 1.0}
    assert reward_extras(samples[3:], "score") == {}
