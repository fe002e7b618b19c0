"""Per-token estimators of KL(pi || pi_ref) from the log-probabilities of the sampled tokens.

With d = logp_ref - logp (natural log, per token, [B, T]) and tokens sampled from pi (Schulman, "Approximating
KL divergence", 2020):

    k1         = logp - logp_ref = -d                 unbiased, high variance, can be negative
    k2         = 0.5 * (logp - logp_ref)^2 = 0.5 d^2  biased, low variance, >= 0
    k3         = exp(d) - d - 1                        unbiased, low variance, >= 0
    low_var_kl = clamp(k3, -10, 10)                    k3 with its tail cut (the name verl and slime use)

Every estimator is exactly 0 where ``loss_mask`` is 0 and where logp == logp_ref.
"""

import torch

from slime_hydra.algo.config import KL_TYPES
from slime_hydra.algo.masked import as_bool_mask


LOW_VAR_KL_BOUND = 10.0
"""low_var_kl is clamped to [-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND] nats per token."""

_LOG_RATIO_BOUND = 20.0
"""low_var_kl clamps d to [-20, 20] before exp: k3 is already > 10 at |d| = 20, so values are unchanged, but
exp never overflows to inf (an inf times the zero gradient of the outer clamp would be NaN in backward)."""


def compute_kl(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor, *,
               kl_loss_type: str) -> torch.Tensor:
    """Per-token KL estimate, [B, T], 0 where ``loss_mask`` is 0.

    Args:
        logp: [B, T] log pi(y_t | y_<t) of the sampled tokens under the policy being measured (the current policy
            for a KL loss, the rollout/old policy for reward shaping).
        ref_logp: [B, T] the same under the reference policy.
        loss_mask: [B, T] nonzero on trained response tokens.
        kl_loss_type: one of KL_TYPES (formulas in the module docstring).

    Plain k3 is the bare formula: exp(d) overflows to inf once d > ~88 in float32, which is what low_var_kl is for.
    Gradients flow into ``logp`` and ``ref_logp`` (callers pass a detached ref).
    """
    if kl_loss_type not in KL_TYPES:
        raise ValueError(f"kl_loss_type={kl_loss_type!r} is not one of {KL_TYPES}")
    mask = as_bool_mask(loss_mask, logp)
    # The difference is masked before any nonlinearity: padded slots see d = 0, where every estimator is 0.
    d = torch.where(mask, ref_logp - logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    if kl_loss_type == "k1":
        return -d
    if kl_loss_type == "k2":
        return 0.5 * d.square()
    if kl_loss_type == "k3":
        return torch.expm1(d) - d
    d = d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return (torch.expm1(d) - d).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
