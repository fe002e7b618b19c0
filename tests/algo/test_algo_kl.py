"""KL estimators against hand-computed values (float64)."""

import math

import pytest
import torch
from torch.testing import assert_close

from slime_hydra.algo import KL_TYPES, compute_kl

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


# logp and ref on two trained tokens and one padded slot holding garbage.
LOGP = t([[-1.0, -2.0, float("nan")]])
REF = t([[-1.5, -1.0, float("inf")]])
MASK = t([[1, 1, 0]])
# d = ref - logp = [-0.5, 1.0, (masked)]


def test_k1_is_logp_minus_ref():
    assert_close(compute_kl(LOGP, REF, MASK, kl_loss_type="k1"), t([[0.5, -1.0, 0.0]]))


def test_k2_is_half_squared_log_ratio():
    # 0.5 * 0.5^2 = 0.125, 0.5 * 1^2 = 0.5
    assert_close(compute_kl(LOGP, REF, MASK, kl_loss_type="k2"), t([[0.125, 0.5, 0.0]]))


def test_k3_is_exp_minus_log_ratio_minus_one():
    # exp(d) - d - 1: d = -0.5 -> exp(-0.5) + 0.5 - 1 = 0.10653...; d = 1 -> e - 2 = 0.71828...
    expected = t([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert_close(compute_kl(LOGP, REF, MASK, kl_loss_type="k3"), expected)
    assert_close(compute_kl(LOGP, REF, MASK, kl_loss_type="low_var_kl"), expected)  # well inside [-10, 10]


def test_low_var_kl_clamps_to_ten_and_k3_does_not():
    logp = t([[0.0, 0.0, 0.0]])
    ref = t([[12.0, -15.0, 2.0]])  # d = 12 -> e^12 - 13; d = -15 -> e^-15 + 14; d = 2 -> e^2 - 3 = 4.389
    mask = t([[1, 1, 1]])
    assert_close(compute_kl(logp, ref, mask, kl_loss_type="k3"),
                 t([[math.exp(12) - 13.0, math.exp(-15) + 14.0, math.exp(2) - 3.0]]))
    assert_close(compute_kl(logp, ref, mask, kl_loss_type="low_var_kl"), t([[10.0, 10.0, math.exp(2) - 3.0]]))


def test_low_var_kl_has_finite_zero_gradient_when_exp_would_overflow():
    logp = t([[-200.0, -1.0]]).requires_grad_()
    ref = t([[0.0, -1.0]])  # d = 200: exp(200) overflows float32 and is huge in float64
    compute_kl(logp.float(), ref.float(), t([[1, 1]]), kl_loss_type="low_var_kl").sum().backward()
    assert_close(logp.grad, t([[0.0, 0.0]]))


@pytest.mark.parametrize("kl_loss_type", KL_TYPES)
def test_every_estimator_is_zero_when_policy_equals_reference(kl_loss_type):
    logp = t([[-0.3, -2.0, -7.0], [-1.1, -0.01, -4.0]])
    kl = compute_kl(logp, logp.clone(), torch.ones(2, 3), kl_loss_type=kl_loss_type)
    assert torch.equal(kl, torch.zeros(2, 3, dtype=F64))


@pytest.mark.parametrize("kl_loss_type", KL_TYPES)
def test_masked_slots_are_zero_and_carry_no_gradient(kl_loss_type):
    logp = LOGP.clone().requires_grad_()
    kl = compute_kl(logp, REF, MASK.bool(), kl_loss_type=kl_loss_type)
    assert kl[0, 2].item() == 0.0
    kl.sum().backward()
    assert logp.grad[0, 2].item() == 0.0
    assert torch.isfinite(logp.grad).all()


def test_gradients_match_the_hand_derivatives():
    # d/dlogp: k1 -> 1; k2 -> (logp - ref) = -d; k3 -> 1 - exp(d)
    d = t([[-0.5, 1.0]])
    for kind, expected in [("k1", torch.ones(1, 2, dtype=F64)), ("k2", -d), ("k3", 1.0 - torch.exp(d))]:
        logp = t([[-1.0, -2.0]]).requires_grad_()
        compute_kl(logp, t([[-1.5, -1.0]]), t([[1, 1]]), kl_loss_type=kind).sum().backward()
        assert_close(logp.grad, expected, msg=kind)


def test_unknown_estimator_and_shape_mismatch_are_refused():
    with pytest.raises(ValueError, match="kl_loss_type='k4'"):
        compute_kl(LOGP, REF, MASK, kl_loss_type="k4")
    with pytest.raises(ValueError, match="loss_mask has shape"):
        compute_kl(LOGP, REF, t([[1, 1]]), kl_loss_type="k1")
