"""What a rollout logs beyond its reward (issue 46 items 3-4): the other entries of dict rewards
(rollout/reward/<key>), the tokens not trained on and the numeric metadata a hook or a row carries."""

from slime_hydra.buffer.sample import Sample
from slime_hydra.rollout.sample_metrics import hook_counters, reward_extras


def test_the_other_entries_of_dict_rewards_are_averaged_over_the_samples_that_have_them():
    rewards = [{"score": 1.0, "format": 0.5, "ok": True, "note": "x"}, {"score": 0.0, "format": 1.0},
               {"score": 0.0, "format": float("nan"), "length_penalty": -0.25}, 0.5]
    samples = [Sample(index=i, group_index=0, prompt="p", reward=r) for i, r in enumerate(rewards)]
    assert reward_extras(samples, "score") == {"rollout/reward/format": 0.75, "rollout/reward/length_penalty": -0.25,
                                               "rollout/reward/ok": 1.0}
    assert reward_extras(samples[3:], "score") == {}


def test_masked_tokens_and_numeric_metadata_are_averaged():
    samples = [Sample(index=0, loss_mask=[1, 1, 0, 0, 0, 1], metadata={"tool_calls": 2, "tool_errors": 1, "task": "x"}),
               Sample(index=1, loss_mask=[1, 1], metadata={"tool_calls": 0, "tool_errors": 0, "level": 3})]
    assert hook_counters(samples) == {"rollout/masked_tokens": 1.5, "rollout/metadata/level": 3.0,
                                      "rollout/metadata/tool_calls": 1.0, "rollout/metadata/tool_errors": 0.5}
    assert hook_counters([]) == {}
