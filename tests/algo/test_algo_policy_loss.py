"""compute_policy_loss: the sum of its terms, slime's metric names, refusals, and padding invariance."""

import math

import pytest
import torch
from torch.testing import assert_close

from slime_hydra.algo import (KL_TYPES, LOSS_AGGS, POLICY_LOSSES, compute_advantages, compute_policy_loss,
                              ppo_clip_loss)

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def scalar(x):
    return torch.tensor(x, dtype=F64)


LOGP = t([[-0.3, -2.0, -1.0], [-0.7, -0.1, -4.0]])
MASK = t([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("kl_loss_type", KL_TYPES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_step_zero(policy_loss, kl_loss_type):
    """At step 0 logp == old == ref: ratio 1, nothing clipped, every KL is exactly 0."""
    adv, _ = compute_advantages("grpo", rewards=t([1, 0]), loss_mask=MASK, group_size=2)
    loss, m = compute_policy_loss(LOGP, LOGP.clone(), adv, MASK, policy_loss=policy_loss, ref_logp=LOGP.clone(),
                                  kl_loss_coef=0.01, kl_loss_type=kl_loss_type, **_eps(policy_loss))
    assert m["ppo_kl"].item() == 0.0
    assert m["pg_clipfrac"].item() == 0.0
    assert m["kl_loss"].item() == 0.0
    if policy_loss != "cispo":  # CISPO's loss value is -A * logp, not -A * r
        # A = +-0.5 / (sqrt(0.5) + 1e-6) on 2 resp. 3 tokens: token_mean of -A = -(2a - 3a) / 5 = a / 5
        a = 0.5 / (math.sqrt(0.5) + 1e-6)
        assert_close(loss, scalar(a / 5))


def _eps(policy_loss):
    return dict(eps_clip=3e-4, eps_clip_high=4e-4) if policy_loss == "gspo" else dict(eps_clip=0.2)


def test_terms_add_up_and_metrics_use_slime_names():
    # ratio 1 everywhere, A = 1: pg = -1. k1 KL vs ref = logp - ref = 0.2 on every token: kl_loss = 0.2.
    # entropy [1, 3 | 2, 2, 2] token mean 2. tis: exp(old - rollout) = exp(1) > cap 2 on every token -> w = 2.
    # loss = 2 * -1 + 0.5 * 0.2 - 0.1 * 2 = -2.1
    logp = LOGP.clone().requires_grad_()
    loss, m = compute_policy_loss(
        logp, LOGP.clone(), torch.ones(2, 3, dtype=F64), MASK, ref_logp=LOGP - 0.2, rollout_logp=LOGP - 1.0,
        entropy=t([[1, 3, 100], [2, 2, 2]]), kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1, tis_cap=2.0)
    assert_close(loss, scalar(-2.1))
    assert set(m) == {"pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "tis", "tis_clipfrac"}
    assert_close(m["pg_loss"], scalar(-2.0))
    assert_close(m["kl_loss"], scalar(0.2))
    assert_close(m["entropy_loss"], scalar(2.0))
    assert_close(m["tis"], scalar(2.0))
    assert_close(m["tis_clipfrac"], scalar(1.0))
    loss.backward()
    # d/dlogp: pg -A r w / 5 = -2 / 5, k1 term 0.5 / 5 -> -0.3 on trained tokens
    assert_close(logp.grad, MASK * -0.3)


def test_minimal_metrics_when_optional_terms_are_off():
    _, m = compute_policy_loss(LOGP, LOGP.clone(), torch.ones(2, 3), MASK)
    assert set(m) == {"pg_loss", "pg_clipfrac", "ppo_kl"}


def test_reference_and_entropy_are_reported_even_with_zero_coefficients():
    loss, m = compute_policy_loss(LOGP, LOGP.clone(), torch.ones(2, 3, dtype=F64), MASK, ref_logp=LOGP - 0.2,
                                  kl_loss_type="k1", entropy=torch.full((2, 3), 3.0, dtype=F64))
    assert_close(loss, scalar(-1.0))
    assert_close((m["kl_loss"], m["entropy_loss"]), (scalar(0.2), scalar(3.0)))


def test_gspo_name_selects_the_sequence_ratio():
    old = LOGP - t([[0.1, -0.3, 0.0], [0.2, 0.0, 0.1]])
    adv = t([[1, 1, 1], [-1, -1, -1]])
    kw = dict(eps_clip=3e-4, eps_clip_high=4e-4, loss_agg="seq_mean_token_mean")
    got = compute_policy_loss(LOGP, old, adv, MASK, policy_loss="gspo", **kw)
    want = ppo_clip_loss(LOGP, old, adv, MASK, ratio_level="sequence", **kw)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy_loss="ppo"), "not one of"),
    (dict(kl_coef=0.1, kl_loss_coef=0.1, ref_logp=LOGP), "use one KL penalty"),
    (dict(kl_loss_coef=0.1), "ref_logp"),
    (dict(tis_cap=2.0), "rollout_logp"),
    (dict(entropy_coef=0.01), "entropy"),
    (dict(eps_clip_c=0.5), "must be > 1"),
    (dict(loss_agg="seq_mean_token_sum_norm"), "max_response_tokens"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(LOGP, LOGP.clone(), torch.ones(2, 3), MASK, **kwargs)


def test_kl_coef_alone_is_fine():
    loss, _ = compute_policy_loss(LOGP, LOGP.clone(), torch.ones(2, 3, dtype=F64), MASK, kl_coef=0.1)
    assert_close(loss, scalar(-1.0))


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_padding_does_not_change_loss_metrics_or_gradient(policy_loss, loss_agg):
    """Extra padded columns full of garbage (NaN logprobs, huge advantages) change nothing."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    old = logp + (torch.rand(3, 4, generator=g, dtype=F64) - 0.5) * 0.6
    ref = logp + (torch.rand(3, 4, generator=g, dtype=F64) - 0.5) * 0.6
    rollout = old + (torch.rand(3, 4, generator=g, dtype=F64) - 0.5)
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    ent = torch.rand(3, 4, generator=g, dtype=F64)
    mask = t([[1, 1, 1, 0], [1, 0, 1, 1], [1, 0, 0, 0]])  # a padded tail and a masked tool token
    kw = dict(policy_loss=policy_loss, loss_agg=loss_agg, max_response_tokens=8, kl_loss_coef=0.05,
              entropy_coef=0.01, tis_cap=1.5, eps_clip_c=3.0 if policy_loss != "cispo" else None, **_eps(policy_loss))
    if policy_loss != "gspo":
        kw.update(eps_clip_high=0.28)

    def run(pad):
        def widen(x, fill):
            return torch.cat([x, torch.full((3, pad), fill, dtype=F64)], dim=1)
        lp = widen(logp, float("nan")).requires_grad_()
        loss, m = compute_policy_loss(lp, widen(old, 7.0), widen(adv, 1e6), widen(mask, 0.0),
                                      ref_logp=widen(ref, float("inf")), rollout_logp=widen(rollout, -1e4),
                                      entropy=widen(ent, float("nan")), **kw)
        loss.backward()
        return loss, m, lp.grad[:, :4], lp.grad[:, 4:]

    loss0, m0, grad0, _ = run(0)
    loss5, m5, grad5, pad_grad = run(5)
    assert torch.isfinite(loss0)
    assert_close(loss5, loss0)
    assert_close(m5, m0)
    assert_close(grad5, grad0)
    assert torch.equal(pad_grad, torch.zeros(3, 5, dtype=F64))
    assert torch.equal(grad0 * (1 - mask), torch.zeros(3, 4, dtype=F64))  # masked tool token gets no gradient
