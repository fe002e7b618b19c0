"""Advantage estimators against hand-computed values (float64)."""

import math

import pytest
import torch
from torch.testing import assert_close

from slime_hydra.algo import (compute_advantages, discounted_returns, gae_advantages, group_normalized_rewards,
                              grpo_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                              shaped_token_rewards, whiten)

F64 = torch.float64
EPS_GRPO = 1e-6
EPS_WHITEN = 1e-8


def t(rows):
    return torch.tensor(rows, dtype=F64)


# ---- GRPO -----------------------------------------------------------------------------------------------------------
def test_grpo_two_groups_of_two():
    # groups [1, 0] and [0, 1]: mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2) / (2 - 1)) = sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + EPS_GRPO)
    adv = grpo_advantages(t([1, 0, 0, 1]), torch.ones(4, 3), group_size=2)
    assert_close(adv, t([[a] * 3, [-a] * 3, [-a] * 3, [a] * 3]))


def test_grpo_without_std_normalization_is_the_centred_reward():
    adv = grpo_advantages(t([1, 0, 0, 1]), torch.ones(4, 2), group_size=2, std_normalization=False)
    assert_close(adv, t([[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.5]]))


def test_grpo_group_of_four_and_an_all_equal_group():
    # group 1 [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
    #   sample var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5] (divided by 0.5 + eps)
    # group 2 [2, 2, 2, 2]: deviations 0, std 0 -> 0 / (0 + eps) = 0, no NaN
    scores = group_normalized_rewards(t([1, 0, 0, 0, 2, 2, 2, 2]), group_size=4)
    s = 0.5 + EPS_GRPO
    assert_close(scores, t([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0]))
    assert torch.equal(scores[4:], torch.zeros(4, dtype=F64))


def test_grpo_all_equal_rewards_give_exact_zeros_with_and_without_std():
    for std_normalization in (True, False):
        adv = grpo_advantages(t([1, 1, 0, 0]), torch.ones(4, 3), group_size=2, std_normalization=std_normalization)
        assert torch.equal(adv, torch.zeros(4, 3, dtype=F64))


def test_grpo_is_zero_on_masked_tokens_and_ignores_padding_width():
    mask = t([[1, 1, 0], [1, 0, 0], [0, 1, 1], [1, 0, 0]])  # row 2 has a masked (tool) token first
    a = 0.5 / (math.sqrt(0.5) + EPS_GRPO)
    adv = grpo_advantages(t([1, 0, 0, 1]), mask, group_size=2)
    assert_close(adv, t([[a, a, 0], [-a, 0, 0], [0, -a, -a], [a, 0, 0]]))
    wider = torch.cat([mask, torch.zeros(4, 2, dtype=F64)], dim=1)
    assert_close(grpo_advantages(t([1, 0, 0, 1]), wider, group_size=2)[:, :3], adv)


def test_grpo_accepts_integer_rewards_and_single_token_responses():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.ones(2, 1), group_size=2, std_normalization=False)
    assert_close(adv, torch.tensor([[0.5], [-0.5]]))


def test_group_estimators_refuse_bad_groups():
    with pytest.raises(ValueError, match="at least 2"):
        group_normalized_rewards(t([1, 0]), group_size=1)
    with pytest.raises(ValueError, match="not a whole number of groups"):
        group_normalized_rewards(t([1, 0, 1]), group_size=2)
    with pytest.raises(ValueError, match=r"must be \[B\]"):
        group_normalized_rewards(t([[1, 0]]), group_size=2)


# ---- whitening ------------------------------------------------------------------------------------------------------
def test_whiten_uses_only_trained_tokens():
    # trained values [1, 2, 3, 4]: mean 2.5, population var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    x = t([[1, 2, 100], [3, 4, -50]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    sd = math.sqrt(1.25 + EPS_WHITEN)
    assert_close(whiten(x, mask), t([[-1.5 / sd, -0.5 / sd, 0], [0.5 / sd, 1.5 / sd, 0]]))


def test_whiten_constant_and_empty_inputs_give_zeros():
    assert torch.equal(whiten(t([[3, 3], [3, 3]]), torch.ones(2, 2)), torch.zeros(2, 2, dtype=F64))
    assert torch.equal(whiten(t([[3, 1], [2, 3]]), torch.zeros(2, 2)), torch.zeros(2, 2, dtype=F64))


# ---- REINFORCE++ ----------------------------------------------------------------------------------------------------
MASK_TOOL = t([[1, 1, 0], [1, 0, 1]])  # row 1 has a tool-output token in the middle: not a policy step
KL = t([[0.1, 0.2, 9.0], [0.3, 9.0, 0.4]])


def test_shaped_rewards_put_the_reward_on_the_last_trained_token_minus_kl():
    # kl_coef 0.5: row 0 [-0.05, 1 - 0.1, 0], row 1 [-0.15, 0 (masked), 2 - 0.2]
    rho = shaped_token_rewards(t([1, 2]), MASK_TOOL, kl_coef=0.5, kl=KL)
    assert_close(rho, t([[-0.05, 0.9, 0.0], [-0.15, 0.0, 1.8]]))


def test_shaped_rewards_drop_the_reward_of_a_sample_without_trained_tokens():
    rho = shaped_token_rewards(t([1, 2]), t([[1, 0], [0, 0]]))
    assert torch.equal(rho, t([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="kl is None"):
        shaped_token_rewards(t([1, 2]), MASK_TOOL, kl_coef=0.1)


def test_discounted_returns_skip_masked_positions():
    # gamma 0.5. row 0: G1 = 0.9, G0 = -0.05 + 0.5 * 0.9 = 0.4
    #            row 1: G2 = 1.8, column 1 is skipped, G0 = -0.15 + 0.5 * 1.8 = 0.75
    rho = t([[-0.05, 0.9, 0.0], [-0.15, 0.0, 1.8]])
    assert_close(discounted_returns(rho, MASK_TOOL, gamma=0.5), t([[0.4, 0.9, 0.0], [0.75, 0.0, 1.8]]))
    # gamma 1: the sum of the remaining rewards. row 0: [0.85, 0.9], row 1: [1.65, _, 1.8]
    assert_close(discounted_returns(rho, MASK_TOOL, gamma=1.0), t([[0.85, 0.9, 0.0], [1.65, 0.0, 1.8]]))


def test_reinforce_pp_whitens_the_shaped_returns():
    # returns above (gamma 0.5): trained values [0.4, 0.9, 0.75, 1.8], mean 3.85 / 4 = 0.9625,
    # deviations [-0.5625, -0.0625, -0.2125, 0.8375], population var 1.066875 / 4 = 0.26671875
    sd = math.sqrt(0.26671875 + EPS_WHITEN)
    adv = reinforce_pp_advantages(t([1, 2]), MASK_TOOL, gamma=0.5, kl_coef=0.5, kl=KL)
    assert_close(adv, t([[-0.5625 / sd, -0.0625 / sd, 0.0], [-0.2125 / sd, 0.0, 0.8375 / sd]]))


def test_reinforce_pp_without_kl_and_gamma_one():
    # every token's return is its sample's reward: [1, 1, 0, 0, 0, 0, 1, 1], mean 0.5, var 0.25 -> +-1
    sd = math.sqrt(0.25 + EPS_WHITEN)
    adv = reinforce_pp_advantages(t([1, 0, 0, 1]), torch.ones(4, 2))
    assert_close(adv, t([[0.5 / sd] * 2, [-0.5 / sd] * 2, [-0.5 / sd] * 2, [0.5 / sd] * 2]))


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens():
    # groups [1, 0] and [3, 3]: centred [0.5, -0.5, 0, 0]; 8 tokens, mean 0, var (4 * 0.25) / 8 = 0.125
    sd = math.sqrt(0.125 + EPS_WHITEN)
    adv = reinforce_pp_baseline_advantages(t([1, 0, 3, 3]), torch.ones(4, 2), group_size=2)
    assert_close(adv, t([[0.5 / sd] * 2, [-0.5 / sd] * 2, [0, 0], [0, 0]]))


# ---- GAE ------------------------------------------------------------------------------------------------------------
def test_gae_by_hand():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # t=2: delta = 1 + 0 - 0.7 = 0.3;            A2 = 0.3
    # t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03;   A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04;   A0 = 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = gae_advantages(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_with_gamma_lam_one_is_monte_carlo_minus_value():
    adv, ret = gae_advantages(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(adv, t([[0.5, 0.4, 0.3]]))
    assert_close(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_skips_masked_positions():
    # column 1 (tool output) and column 3 (padding) hold garbage values; the recursion sees [0, 1] / [0.5, 0.7]:
    # t=2: A = 1 - 0.7 = 0.3; t=0: delta = 0.9 * 0.7 - 0.5 = 0.13, A = 0.13 + 0.72 * 0.3 = 0.346
    adv, ret = gae_advantages(t([[0, 5, 1, 7]]), t([[0.5, 99, 0.7, 42]]), t([[1, 0, 1, 0]]), gamma=0.9, lam=0.8)
    assert_close(adv, t([[0.346, 0.0, 0.3, 0.0]]))
    assert_close(ret, t([[0.846, 0.0, 1.0, 0.0]]))


def test_gae_single_token_response():
    adv, ret = gae_advantages(t([[2.0], [0.0]]), t([[0.5], [0.25]]), torch.ones(2, 1), gamma=0.9, lam=0.95)
    assert_close(adv, t([[1.5], [-0.25]]))
    assert_close(ret, t([[2.0], [0.0]]))


# ---- dispatcher -----------------------------------------------------------------------------------------------------
def test_dispatcher_matches_the_estimators():
    rewards, mask = t([1, 0, 0, 1]), t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages("grpo", rewards=rewards, loss_mask=mask, group_size=2)
    assert_close(adv, grpo_advantages(rewards, mask, group_size=2))
    assert_close(ret, adv)

    adv, ret = compute_advantages("reinforce_pp", rewards=rewards, loss_mask=mask, gamma=0.5)
    assert_close(adv, reinforce_pp_advantages(rewards, mask, gamma=0.5))
    # returns before whitening: row 0 [0.5, 1, 0], row 2 [0, 0, 0], row 3 [1, 0, 0]
    assert_close(ret, t([[0.5, 1, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]]))

    adv, _ = compute_advantages("reinforce_pp_baseline", rewards=rewards, loss_mask=mask, group_size=2)
    assert_close(adv, reinforce_pp_baseline_advantages(rewards, mask, group_size=2))


def test_dispatcher_gae_builds_token_rewards_from_the_sequence_reward():
    # reward 1 on the last token, k1 shaping 0.5 * [0.2, 0.4, 0.6]: rho = [-0.1, -0.2, 1 - 0.3]
    values = t([[0.5, 0.6, 0.7]])
    adv, ret = compute_advantages("gae", rewards=t([1]), loss_mask=torch.ones(1, 3), values=values, gamma=1.0,
                                  lam=1.0, kl_coef=0.5, kl=t([[0.2, 0.4, 0.6]]))
    # gamma = lam = 1: returns are reward-to-go [0.4, 0.5, 0.7], advantages returns - values
    assert_close(ret, t([[0.4, 0.5, 0.7]]))
    assert_close(adv, t([[-0.1, -0.1, 0.0]]))


def test_dispatcher_normalize_advantages_whitens():
    # Dr.GRPO advantages +-0.5 on 8 tokens: mean 0, var 0.25 -> +-0.5 / sqrt(0.25 + 1e-8)
    sd = math.sqrt(0.25 + EPS_WHITEN)
    adv, _ = compute_advantages("grpo", rewards=t([1, 0, 0, 1]), loss_mask=torch.ones(4, 2), group_size=2,
                                std_normalization=False, normalize_advantages=True)
    assert_close(adv, t([[0.5 / sd] * 2, [-0.5 / sd] * 2, [-0.5 / sd] * 2, [0.5 / sd] * 2]))


def test_dispatcher_refusals():
    kw = dict(rewards=t([1, 0]), loss_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="not one of"):
        compute_advantages("ppo", **kw)
    with pytest.raises(ValueError, match="needs group_size"):
        compute_advantages("grpo", **kw)
    with pytest.raises(ValueError, match="needs group_size"):
        compute_advantages("reinforce_pp_baseline", **kw)
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages("gae", **kw)
    with pytest.raises(ValueError, match="no reward shaping"):
        compute_advantages("grpo", group_size=2, kl_coef=0.1, kl=torch.zeros(2, 2), **kw)


def test_advantages_carry_no_gradient():
    values = t([[0.5, 0.6]]).requires_grad_()
    adv, ret = compute_advantages("gae", rewards=t([1]), loss_mask=torch.ones(1, 2), values=values)
    assert not adv.requires_grad and not ret.requires_grad
