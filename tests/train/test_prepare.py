"""Scored samples -> TrainBatch -> advantages, against hand-computed GRPO numbers."""

import pytest
import torch

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.buffer.sample import Sample
from slime_hydra.train.prepare import add_advantages, needs_old_logprobs, to_train_batch


def _samples():
    # two groups of two: rewards [1, 0] and [1, 1]; prompts of 2 tokens, responses of 3 and 1 tokens
    rows = [([5, 6, 7, 8, 9], 3, [1, 0, 1], 1.0), ([5, 6, 7], 1, [1], 0.0),
            ([4, 4, 1, 2], 2, [1, 1], 1.0), ([4, 4, 3], 1, [1], 1.0)]
    return [Sample(index=i, group_index=i // 2, tokens=t, response_length=r, loss_mask=m, reward=rw,
                   rollout_log_probs=[-0.5] * r) for i, (t, r, m, rw) in enumerate(rows)]


def test_grpo_advantages_from_samples():
    batch = to_train_batch(_samples(), pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0], [4, 4, 1, 2, 0], [4, 4, 3, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 0, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert batch.extras["rollout_logprobs"][1].tolist() == [-0.5, 0, 0]
    old = torch.zeros(batch.loss_mask.shape)
    metrics = add_advantages(batch, AlgoConfig(), group_size=2, old_logprobs=old)
    # group 0: mean 0.5, sample std (n-1) = 0.7071 -> +-0.7071; group 1: all equal -> 0
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    expected = torch.tensor([[a, 0, a], [-a, 0, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(batch.extras["advantages"], expected, atol=1e-5, rtol=0)
    assert metrics == {"train/advantage_abs_mean": pytest.approx(3 * a / 6, abs=1e-6)}  # 3 of 6 trained tokens
    assert batch.extras["old_logprobs"] is old


def test_reward_shaping_needs_the_reference():
    batch = to_train_batch(_samples(), pad_id=0)
    with pytest.raises(ValueError, match="old and ref logprobs needed"):
        add_advantages(batch, AlgoConfig(advantage_estimator="reinforce_pp", kl_coef=0.1), group_size=2,
                       old_logprobs=torch.zeros(batch.loss_mask.shape))
    with pytest.raises(ValueError, match="old and ref logprobs needed"):   # no old logprobs either
        add_advantages(batch, AlgoConfig(advantage_estimator="reinforce_pp", kl_coef=0.1), group_size=2,
                       old_logprobs=None, ref_logprobs=torch.zeros(batch.loss_mask.shape))


def test_reward_shaping_reports_the_kl_it_optimizes():
    """k1 KL = old - ref per token: 0.3 on every trained token, so its mean over the 6 trained tokens is 0.3."""
    batch = to_train_batch(_samples(), pad_id=0)
    old, ref = torch.full(batch.loss_mask.shape, -1.0), torch.full(batch.loss_mask.shape, -1.3)
    metrics = add_advantages(batch, AlgoConfig(advantage_estimator="reinforce_pp", kl_coef=0.1, kl_loss_type="k1"),
                             group_size=2, old_logprobs=old, ref_logprobs=ref)
    assert metrics["train/reward_kl"] == pytest.approx(0.3, abs=1e-6)


def test_one_optimizer_step_needs_no_separate_old_logprobs_pass():
    grpo = AlgoConfig()
    assert not needs_old_logprobs(grpo, 1)
    assert needs_old_logprobs(grpo, 2) and needs_old_logprobs(AlgoConfig(kl_coef=0.1), 1)


def test_empty_response_is_refused():
    bad = _samples()
    bad[0].tokens, bad[0].response_length, bad[0].loss_mask, bad[0].rollout_log_probs = [1, 2], 0, [], []
    with pytest.raises(ValueError, match="empty response"):
        to_train_batch(bad, pad_id=0)


def test_dapo_overlong_penalty_shapes_the_rewards():
    """Budget 4, buffer 2: lengths 3 and 1 (group 0) get -0.5 and 0, lengths 2 and 1 (group 1) 0 and 0."""
    from slime_hydra.algo import overlong_penalty

    assert overlong_penalty(torch.tensor([1, 2, 3, 4, 5]), max_response_tokens=4, buffer_tokens=2,
                            penalty=2.0).tolist() == [0.0, 0.0, -1.0, -2.0, -2.0]
    batch = to_train_batch(_samples(), pad_id=0)
    algo = AlgoConfig(overlong_buffer_tokens=2, overlong_penalty=1.0)
    metrics = add_advantages(batch, algo, group_size=2, old_logprobs=None, max_response_tokens=4)
    assert batch.extras["overlong_penalty"].tolist() == [-0.5, 0.0, 0.0, 0.0]
    assert metrics["train/overlong_penalty"] == -0.125
    assert batch.extras["rewards"].tolist() == [0.5, 0.0, 1.0, 1.0]
    a = 0.25 / ((0.125 ** 0.5) + 1e-6)  # group 0: rewards 0.5, 0 -> mean 0.25, sample std 0.3536
    assert batch.extras["advantages"][:2, 0].tolist() == pytest.approx([a, -a], abs=1e-5)
    with pytest.raises(ValueError, match="max_response_tokens"):
        add_advantages(to_train_batch(_samples(), pad_id=0), algo, group_size=2, old_logprobs=None)


def test_opd_advantage_is_minus_the_reverse_kl_to_the_teacher_plus_the_weighted_reward_advantage():
    """A_t = reward_weight x GRPO's A_t - kl_coef x (student_t - teacher_t), the student being the engine's logprobs
    (-0.5 on every token) when no old-logprob pass ran; the reverse KL's mean over the 6 trained tokens is reported."""
    batch = to_train_batch(_samples(), pad_id=0)
    teacher = torch.tensor([[-0.1, -9.0, -0.2], [-1.0, -9.0, -9.0], [-0.5, -0.3, -9.0], [-2.0, -9.0, -9.0]])
    algo = AlgoConfig(name="opd", objective="opd")
    algo.teacher.path, algo.teacher.kl_coef, algo.teacher.reward_weight = "tiny", 2.0, 0.5
    metrics = add_advantages(batch, algo, group_size=2, old_logprobs=None, teacher=teacher)
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # GRPO's, as in test_grpo_advantages_from_samples
    grpo = torch.tensor([[a, 0, a], [-a, 0, 0], [0, 0, 0], [0, 0, 0]])
    reverse_kl = (-0.5 - teacher) * batch.loss_mask  # [[-0.4, 0, -0.3], [0.5, 0, 0], [0, -0.2, 0], [1.5, 0, 0]]
    torch.testing.assert_close(batch.extras["advantages"], 0.5 * grpo - 2.0 * reverse_kl, atol=1e-6, rtol=0)
    assert metrics["train/opd_reverse_kl"] == pytest.approx((-0.4 - 0.3 + 0.5 - 0.2 + 1.5) / 6, abs=1e-6)
    assert metrics["train/teacher_logprob"] == pytest.approx((-0.1 - 0.2 - 1.0 - 0.5 - 0.3 - 2.0) / 6, abs=1e-6)
    assert batch.extras["teacher_logprobs"] is teacher
    # with old logprobs (an extra pass ran), they are the student's: the same as the teacher's -> the KL term is 0
    batch = to_train_batch(_samples(), pad_id=0)
    algo.teacher.reward_weight = 0.0
    metrics = add_advantages(batch, algo, group_size=2, old_logprobs=teacher.clone(), teacher=teacher)
    assert metrics["train/opd_reverse_kl"] == 0.0 and float(batch.extras["advantages"].abs().max()) == 0.0


def test_dpo_weights_are_beta_sigmoid_minus_z_on_each_pairs_rows():
    """Two pairs (rows 0/1 and 2/3, chosen then rejected): s = summed (policy - ref) logprobs over the trained
    tokens, z = beta (s_chosen - s_rejected); each row's tokens get +-beta sigmoid(-z); TRL's metrics by hand."""
    rows = [([5, 6, 7, 8, 9], 3, [1, 0, 1], 1.0), ([5, 6, 7], 1, [1], 0.0),
            ([4, 4, 1, 2], 2, [1, 1], 1.0), ([4, 4, 3], 1, [1], 0.0)]
    batch = to_train_batch([Sample(index=i, group_index=i // 2, tokens=t, response_length=r, loss_mask=m, reward=rw)
                            for i, (t, r, m, rw) in enumerate(rows)], pad_id=0)
    policy = torch.tensor([[-1.0, -5.0, -2.0], [-4.0, 0, 0], [-1.0, -1.0, 0], [-0.5, 0, 0]])
    ref = torch.tensor([[-2.0, -9.0, -2.0], [-3.0, 0, 0], [-1.0, -1.5, 0], [-0.5, 0, 0]])
    algo = AlgoConfig(name="dpo", objective="dpo", loss_agg="seq_mean_token_sum")
    algo.dpo.beta = 0.5
    metrics = add_advantages(batch, algo, group_size=2, old_logprobs=policy, ref_logprobs=ref)
    # s per row: [1.0, -1.0, 0.5, 0.0] (row 0: (-1 + -2) - (-2 + -2), the masked -5 / -9 left out)
    z = 0.5 * torch.tensor([1.0 - -1.0, 0.5 - 0.0])  # [1.0, 0.25]
    w = 0.5 * torch.sigmoid(-z)
    expected = torch.stack([w[0] * batch.loss_mask[0], -w[0] * batch.loss_mask[1], w[1] * batch.loss_mask[2],
                            -w[1] * batch.loss_mask[3]])
    torch.testing.assert_close(batch.extras["advantages"], expected, atol=1e-6, rtol=0)
    assert metrics["train/dpo_loss"] == pytest.approx(float(-torch.nn.functional.logsigmoid(z).mean()), abs=1e-6)
    assert metrics["train/dpo_accuracy"] == 1.0 and metrics["train/dpo_margin"] == pytest.approx(0.625, abs=1e-6)
    assert metrics["train/dpo_chosen_reward"] == pytest.approx(0.5 * (1.0 + 0.5) / 2, abs=1e-6)
    assert metrics["train/dpo_rejected_reward"] == pytest.approx(0.5 * (-1.0 + 0.0) / 2, abs=1e-6)
    batch.extras["rewards"] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # a pair in the wrong order is refused
    with pytest.raises(ValueError, match="chosen .reward 1. then rejected"):
        add_advantages(batch, algo, group_size=2, old_logprobs=policy, ref_logprobs=ref)
