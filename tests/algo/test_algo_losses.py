"""Loss aggregation, PPO-clip / GSPO / CISPO, TIS, value, entropy, SFT and KL losses against hand computations."""

import math

import pytest
import torch
from torch.testing import assert_close

from slime_hydra.algo import (LOSS_AGGS, aggregate, cispo_loss, entropy_loss, kl_loss, log_ratio, ppo_clip_loss,
                              sft_loss, truncated_is_weights, value_loss)

F64 = torch.float64
NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=F64)


def scalar(x):
    return torch.tensor(x, dtype=F64)


# ---- aggregation ----------------------------------------------------------------------------------------------------
X = t([[1, 2, 3], [4, 5, 6]])
MASK = t([[1, 1, 0], [1, 0, 0]])  # lengths 2 and 1


@pytest.mark.parametrize("loss_agg,expected", [
    ("token_mean", 7 / 3),                        # (1 + 2 + 4) / 3
    ("seq_mean_token_mean", 2.75),                # ((1 + 2) / 2 + 4 / 1) / 2
    ("seq_mean_token_sum", 3.5),                  # ((1 + 2) + 4) / 2
    ("seq_mean_token_sum_norm", 0.875),           # ((1 + 2) / 4 + 4 / 4) / 2 with max_response_tokens 4
])
def test_aggregate_modes(loss_agg, expected):
    assert_close(aggregate(X, MASK, loss_agg, max_response_tokens=4), scalar(expected))


@pytest.mark.parametrize("loss_agg,expected", [
    ("token_mean", 1.5),                          # (1 + 2) / 2
    ("seq_mean_token_mean", 0.75),                # (1.5 + 0) / 2: the empty row counts, as 0
    ("seq_mean_token_sum", 1.5),                  # (3 + 0) / 2
    ("seq_mean_token_sum_norm", 0.75),            # (3 / 2 + 0) / 2 with max_response_tokens 2
])
def test_aggregate_fully_masked_sequence_counts_as_zero_not_nan(loss_agg, expected):
    x = t([[1, 2], [NAN, NAN]]).requires_grad_()
    out = aggregate(x, t([[1, 1], [0, 0]]), loss_agg, max_response_tokens=2)
    assert_close(out, scalar(expected))
    out.backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[1], t([0, 0]))


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_aggregate_all_masked_is_zero(loss_agg):
    assert aggregate(X, torch.zeros(2, 3), loss_agg, max_response_tokens=4).item() == 0.0


def test_aggregate_gradients():
    # token_mean: d/dx = m / 3; seq_mean_token_mean: m / (2 * len_i) -> [0.25, 0.25, 0], [0.5, 0, 0]
    for loss_agg, expected in [("token_mean", MASK / 3), ("seq_mean_token_mean", t([[0.25, 0.25, 0], [0.5, 0, 0]])),
                               ("seq_mean_token_sum_norm", MASK / 8)]:
        x = X.clone().requires_grad_()
        aggregate(x, MASK, loss_agg, max_response_tokens=4).backward()
        assert_close(x.grad, expected, msg=loss_agg)


def test_aggregate_refusals():
    with pytest.raises(ValueError, match="max_response_tokens"):
        aggregate(X, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="not one of"):
        aggregate(X, MASK, "sum")


# ---- PPO clip, one token at a time -------------------------------------------------------------------------------
def one_token(ratio, adv, **kw):
    """Loss, clipfrac and d loss / d logp for a single trained token with the given ratio (old_logp = 0)."""
    logp = torch.log(scalar(ratio)).reshape(1, 1).requires_grad_()
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 1, dtype=F64), t([[adv]]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), metrics["pg_clipfrac"].item(), logp.grad.item()


ASYM = dict(eps_clip=0.2, eps_clip_high=0.28)


@pytest.mark.parametrize("ratio,adv,loss,clipfrac,grad", [
    # A > 0: l = max(-r, -clamp(r, 0.8, 1.28)); gradient -A r where unclipped
    (1.5, 1.0, -1.28, 1.0, 0.0),     # above 1 + eps_high: clipped, no gradient
    (1.1, 1.0, -1.1, 0.0, -1.1),     # inside
    (0.5, 1.0, -0.5, 0.0, -0.5),     # below 1 - eps with A > 0: -0.5 > -0.8, the unclipped term wins
    # A < 0: l = max(r, clamp(r, 0.8, 1.28))
    (0.5, -1.0, 0.8, 1.0, 0.0),      # below 1 - eps: clipped
    (1.5, -1.0, 1.5, 0.0, 1.5),      # above 1 + eps_high with A < 0: not clipped (no dual clip here)
    (1.0, 2.0, -2.0, 0.0, -2.0),     # step 0: r = 1
])
def test_ppo_clip_single_token_cases(ratio, adv, loss, clipfrac, grad):
    got = one_token(ratio, adv, **ASYM)
    assert_close(got, (loss, clipfrac, grad))


def test_ppo_clip_symmetric_when_eps_clip_high_is_none():
    assert_close(one_token(1.25, 1.0, eps_clip=0.2), (-1.2, 1.0, 0.0))


def test_ppo_clip_ratio_exactly_at_the_bounds_is_not_clipped():
    # ratios exactly representable after exp: pick d, then set the clip range to exp(d) - 1 / 1 - exp(-d)
    hi = torch.exp(scalar(0.25)).item()
    lo = torch.exp(scalar(-0.25)).item()
    eps_high, eps_low = hi - 1.0, 1.0 - lo
    for ratio, adv in [(hi, 1.0), (hi, -1.0), (lo, 1.0), (lo, -1.0)]:
        loss, clipfrac, grad = one_token(ratio, adv, eps_clip=eps_low, eps_clip_high=eps_high)
        assert clipfrac == 0.0
        assert_close(loss, -adv * ratio)


@pytest.mark.parametrize("ratio,adv,loss,grad", [
    (4.0, -1.0, 3.0, 0.0),     # A < 0, r = 4: the PPO loss 4 is capped at -A * c = 3, no gradient
    (2.0, -1.0, 2.0, 2.0),     # A < 0, r = 2 < c: unchanged
    (4.0, 1.0, -1.28, 0.0),    # A > 0: the dual clip never applies
])
def test_dual_clip(ratio, adv, loss, grad):
    got_loss, clipfrac, got_grad = one_token(ratio, adv, eps_clip_c=3.0, **ASYM)
    assert_close((got_loss, got_grad), (loss, grad))


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="must be > 1"):
        one_token(1.0, 1.0, eps_clip_c=1.0)


# ---- PPO clip, batched with padding ------------------------------------------------------------------------------
def test_ppo_clip_batch_token_mean_ppo_kl_and_gradient():
    # trained ratios [1.1, 1.5 | 0.5], advantages [1, 1 | -1], eps 0.2 / 0.28
    # per token: [-1.1, -1.28 | 0.8] -> token_mean (-1.1 - 1.28 + 0.8) / 3; clipped tokens 2 of 3
    logp = torch.log(t([[1.1, 1.5, 1.0], [0.5, 1.0, 1.0]]))
    logp[0, 2] = NAN  # padding garbage
    logp.requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    adv = t([[1, 1, 1], [-1, -1, -1]])
    loss, m = ppo_clip_loss(logp, old, adv, MASK, **ASYM)
    assert_close(loss, scalar((-1.1 - 1.28 + 0.8) / 3))
    assert_close(m["pg_clipfrac"], scalar(2 / 3))
    # ppo_kl = mean(old - logp) = -(log 1.1 + log 1.5 + log 0.5) / 3
    assert_close(m["ppo_kl"], scalar(-(math.log(1.1) + math.log(1.5) + math.log(0.5)) / 3))
    loss.backward()
    # only the unclipped token moves: d/dlogp (-A r) / 3 = -1.1 / 3
    assert_close(logp.grad, t([[-1.1 / 3, 0, 0], [0, 0, 0]]))


def test_ppo_clip_seq_mean_token_mean_metrics_are_per_sequence():
    logp = torch.log(t([[1.1, 1.5, 1.0], [0.5, 1.0, 1.0]]))
    adv = t([[1, 1, 1], [-1, -1, -1]])
    loss, m = ppo_clip_loss(logp, torch.zeros(2, 3, dtype=F64), adv, MASK, loss_agg="seq_mean_token_mean", **ASYM)
    assert_close(loss, scalar(((-1.1 - 1.28) / 2 + 0.8) / 2))
    assert_close(m["pg_clipfrac"], scalar((0.5 + 1.0) / 2))


def test_step_zero_ratio_one():
    logp = t([[-0.3, -2.0, -1.0], [-0.7, -0.1, -4.0]])
    adv = t([[0.5, 0.5, 0.5], [-0.25, -0.25, -0.25]])
    loss, m = ppo_clip_loss(logp, logp.clone(), adv, MASK, **ASYM)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    assert_close(loss, scalar(-(0.5 + 0.5 - 0.25) / 3))


# ---- GSPO ---------------------------------------------------------------------------------------------------------
GSPO_LOGP = t([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]])
GSPO_OLD = t([[-1.2, -1.9, 5.0], [-0.7, 5.0, 5.0]])
GSPO_ADV = t([[1, 1, 1], [-1, -1, -1]])
# log s_0 = mean(0.2, -0.1) = 0.05, log s_1 = 0.2
S0, S1 = math.exp(0.05), math.exp(0.2)


def test_sequence_log_ratio_value_is_the_mean_token_log_ratio():
    assert_close(log_ratio(GSPO_LOGP, GSPO_OLD, MASK, "sequence"), t([[0.05, 0.05, 0], [0.2, 0, 0]]))
    with pytest.raises(ValueError, match="ratio_level"):
        log_ratio(GSPO_LOGP, GSPO_OLD, MASK, "group")


def test_gspo_loss_and_gradient_equal_the_sequence_level_objective():
    # eps 0.2 / 0.28: s_0 = 1.051 (A > 0) inside; s_1 = 1.221 with A < 0: l = max(s_1, 1.221) = s_1
    logp = GSPO_LOGP.clone().requires_grad_()
    loss, m = ppo_clip_loss(logp, GSPO_OLD, GSPO_ADV, MASK, ratio_level="sequence", loss_agg="seq_mean_token_mean",
                            **ASYM)
    assert_close(loss, scalar((-S0 + S1) / 2))
    assert m["pg_clipfrac"].item() == 0.0
    loss.backward()
    # hand: d/dlogp_{i,t} = -(1/B) A_i s_i / |y_i| -> row 0: -S0 / 4 per token, row 1: +S1 / 2
    assert_close(logp.grad, t([[-S0 / 4, -S0 / 4, 0], [S1 / 2, 0, 0]]))

    # autograd of the sequence-level objective J = -(1/B) sum_i A_i exp(mean_t(logp - old))
    ref = t([[-1.0, -2.0], [-0.5, 0.0]]).requires_grad_()
    old = t([[-1.2, -1.9], [-0.7, 0.0]])
    s = torch.stack([torch.exp((ref[0] - old[0]).mean()), torch.exp(ref[1, 0] - old[1, 0])])
    (-(t([1, -1]) * s).mean()).backward()
    assert_close(logp.grad[:, :2], ref.grad * t([[1, 1], [1, 0]]))


def test_gspo_clips_whole_sequences_with_tight_eps():
    # eps 3e-4 / 4e-4: s_0 = 1.051 > 1.0004 with A > 0 -> row 0 clipped (both tokens, no gradient);
    # s_1 = 1.221 with A < 0 -> unclipped
    logp = GSPO_LOGP.clone().requires_grad_()
    loss, m = ppo_clip_loss(logp, GSPO_OLD, GSPO_ADV, MASK, eps_clip=3e-4, eps_clip_high=4e-4,
                            ratio_level="sequence", loss_agg="seq_mean_token_mean")
    assert_close(loss, scalar((-1.0004 + S1) / 2))
    assert_close(m["pg_clipfrac"], scalar(0.5))  # row 0 fully clipped, row 1 not
    # ppo_kl stays token-level: rows' mean(old - logp) = -0.05 and -0.2
    assert_close(m["ppo_kl"], scalar((-0.05 - 0.2) / 2))
    loss.backward()
    assert_close(logp.grad, t([[0, 0, 0], [S1 / 2, 0, 0]]))


# ---- CISPO ------------------------------------------------------------------------------------------------------
def test_cispo_loss_gradient_and_clipfrac():
    # r = [1.5, 0.5, 1.1], A = [1, -1, 2], eps 0.2 / 0.28 -> w = clamp(r) = [1.28, 0.8, 1.1]
    ratios = t([[1.5, 0.5, 1.1]])
    logp = torch.log(ratios).requires_grad_()
    old = torch.zeros(1, 3, dtype=F64).requires_grad_()
    adv = t([[1, -1, 2]])
    loss, m = cispo_loss(logp, old, adv, torch.ones(1, 3), **ASYM)
    # l = -w A logp, token_mean
    expected = -(1.28 * 1 * math.log(1.5) + 0.8 * -1 * math.log(0.5) + 1.1 * 2 * math.log(1.1)) / 3
    assert_close(loss, scalar(expected))
    assert_close(m["pg_clipfrac"], scalar(2 / 3))
    loss.backward()
    # the weight is a constant: d/dlogp = -w A / 3, nonzero even on the clipped tokens (unlike PPO)
    assert_close(logp.grad, t([[-1.28 / 3, 0.8 / 3, -2.2 / 3]]))
    assert old.grad is None  # no gradient reaches the IS weight's inputs


def test_cispo_eps_clip_one_disables_the_lower_bound():
    logp = torch.log(t([[0.1]])).requires_grad_()
    loss, m = cispo_loss(logp, torch.zeros(1, 1, dtype=F64), t([[1.0]]), torch.ones(1, 1), eps_clip=1.0,
                         eps_clip_high=0.28)
    loss.backward()
    assert_close(logp.grad, t([[-0.1]]))
    assert m["pg_clipfrac"].item() == 0.0


# ---- TIS ----------------------------------------------------------------------------------------------------------
def test_truncated_is_weights():
    # exp(old - rollout) = [3, 1, 0.5, (masked)], cap 2 -> [2, 1, 0.5, 1]
    old = torch.zeros(1, 4, dtype=F64).requires_grad_()
    rollout = t([[-math.log(3), 0.0, math.log(2), -100.0]])
    w, m = truncated_is_weights(old, rollout, t([[1, 1, 1, 0]]), tis_cap=2.0)
    assert_close(w, t([[2.0, 1.0, 0.5, 1.0]]))
    assert not w.requires_grad
    assert_close(m["tis"], scalar(3.5 / 3))
    assert_close(m["tis_clipfrac"], scalar(1 / 3))
    with pytest.raises(ValueError, match="tis_cap"):
        truncated_is_weights(old, rollout, t([[1, 1, 1, 0]]), tis_cap=0.0)


def test_tis_weights_multiply_the_token_pg_loss():
    # ratio 1, A = 1: per-token pg -1, times w = [2, 1, 0.5] -> loss -3.5 / 3, gradient -A r w / 3
    logp = torch.zeros(1, 3, dtype=F64).requires_grad_()
    w = t([[2.0, 1.0, 0.5]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=F64), torch.ones(1, 3),
                            tis_weights=w)
    assert_close(loss, scalar(-3.5 / 3))
    loss.backward()
    assert_close(logp.grad, -w / 3)


# ---- value, entropy, SFT, KL ------------------------------------------------------------------------------------
def test_value_loss_clipping():
    # clip 0.25. t0: V - old = 0.125 inside -> both errors (1 - 1.5)^2 = 0.25 -> 0.125
    #            t1: V - old = -0.5 -> v_clip = 2.25; (2 - 1)^2 = 1 < (2.25 - 1)^2 = 1.5625 -> 0.78125, clipped
    #            t2: V = old -> (0 - 1)^2 = 1 -> 0.5
    values = t([[1.0, 2.0, 0.0]]).requires_grad_()
    old = t([[0.875, 2.5, 0.0]])
    returns = t([[1.5, 1.0, 1.0]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 3), value_clip=0.25)
    assert_close(loss, scalar((0.125 + 0.78125 + 0.5) / 3))
    assert_close(m["value_clipfrac"], scalar(1 / 3))
    loss.backward()
    # d/dV 0.5 (V - R)^2 = V - R where the unclipped error counts; 0 where the clipped one wins
    assert_close(values.grad, t([[-0.5 / 3, 0.0, -1.0 / 3]]))


def test_value_loss_without_clip():
    loss, m = value_loss(t([[1.0, 2.0]]), t([[0.0, 0.0]]), t([[0.0, 0.0]]), torch.ones(1, 2), value_clip=None)
    assert_close(loss, scalar((0.5 * 1 + 0.5 * 4) / 2))
    assert m["value_clipfrac"].item() == 0.0


def test_entropy_loss_subtracts_the_bonus():
    ent = t([[1.0, 2.0, 9.0]])
    loss, m = entropy_loss(ent, t([[1, 1, 0]]), entropy_coef=0.01)
    assert_close(loss, scalar(-0.01 * 1.5))
    assert_close(m["entropy_loss"], scalar(1.5))


def test_sft_loss_is_masked_nll():
    logp = t([[-1.0, -3.0, NAN]]).requires_grad_()
    loss, m = sft_loss(logp, t([[1, 1, 0]]))
    assert_close(loss, scalar(2.0))
    loss.backward()
    assert_close(logp.grad, t([[-0.5, -0.5, 0.0]]))


def test_kl_loss_is_coef_times_aggregated_kl():
    # k1 = logp - ref = [0.5, -1.0] -> mean -0.25; k2 -> mean(0.125, 0.5) = 0.3125
    logp, ref, mask = t([[-1.0, -2.0, NAN]]), t([[-1.5, -1.0, 0.0]]), t([[1, 1, 0]])
    loss, m = kl_loss(logp, ref, mask, kl_loss_type="k1", kl_loss_coef=0.1)
    assert_close(loss, scalar(-0.025))
    assert_close(m["kl_loss"], scalar(-0.25))
    loss, m = kl_loss(logp, ref, mask, kl_loss_type="k2", kl_loss_coef=0.1)
    assert_close((loss, m["kl_loss"]), (scalar(0.03125), scalar(0.3125)))


def test_rollout_mismatch_against_hand_numbers():
    from slime_hydra.algo import rollout_mismatch

    logp = t([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
    rollout = t([[-1.0, -2.5, -0.1], [-0.3, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = rollout_mismatch(logp, rollout, mask)
    diffs = [0.0, 0.5, -0.4, 0.2]  # the masked slot's 5.0 difference is ignored
    assert float(m["train_rollout_logprob_abs_diff"]) == pytest.approx(sum(map(abs, diffs)) / 4)
    assert float(m["train_rollout_logprob_abs_diff_max"]) == pytest.approx(0.5)
    assert float(m["train_rollout_ratio_abs_dev"]) == pytest.approx(sum(abs(math.exp(d) - 1) for d in diffs) / 4)
    same = rollout_mismatch(logp, logp, mask)
    assert all(float(v) == 0 for v in same.values())


def test_masked_is_drops_implausible_tokens_from_the_pg_loss():
    from slime_hydra.algo import compute_policy_loss, masked_is_weights

    old = t([[0.0, 0.0, 0.0, 0.0]])
    rollout = t([[0.0, -0.5, -1.0, 0.8]])  # ratios 1, e^0.5 = 1.65, e^1 = 2.72, e^-0.8 = 0.45
    mask = torch.tensor([[1, 1, 1, 1]])
    weights, m = masked_is_weights(old, rollout, mask, mis_cap=2.0)
    assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0]] and float(m["mis_maskfrac"]) == 0.5
    # pg loss with A = 1 everywhere and logp = old (ratio 1): -1 per kept token, token mean over all 4 tokens
    loss, metrics = compute_policy_loss(old.clone().requires_grad_(), old, torch.ones(1, 4, dtype=F64), mask,
                                        rollout_logp=rollout, mis_cap=2.0)
    assert float(loss) == pytest.approx(-0.5) and float(metrics["mis_maskfrac"]) == 0.5
    with pytest.raises(ValueError, match="must be > 1"):
        masked_is_weights(old, rollout, mask, mis_cap=1.0)
