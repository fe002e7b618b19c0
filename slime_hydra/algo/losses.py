"""Policy, value, entropy, SFT and KL losses over padded response tokens, and their aggregation.

Shapes: token tensors are [B, T] over response positions; ``loss_mask`` [B, T] is nonzero on trained tokens.
``logp`` is log pi_theta(y_t | y_<t) of the sampled token under the policy being trained (carries the gradient);
``old_logp`` the same under the policy before this round of updates (trainer-side, detached); ``rollout_logp``
the same as reported by the inference engine that sampled (detached); ``ref_logp`` under the frozen reference.

Each loss returns ``(loss, metrics)``: a 0-dim tensor to backpropagate and a dict of detached 0-dim tensors.
Loss terms (pg_loss, kl_loss, entropy_loss, value_loss, sft_loss) are reported as aggregated by ``loss_agg``, i.e.
the value that enters the loss. Diagnostics (pg_clipfrac, ppo_kl, tis, tis_clipfrac, value_clipfrac) are means
over tokens for ``loss_agg="token_mean"`` and means over sequences of per-sequence token means for the seq_mean_*
modes, so that both are unbiased under the trainer's micro-batch weighting (tokens resp. sequences as units,
see ``slime_hydra.train.batch.loss_units``).

``compute_policy_loss`` is the one the trainer calls: pg (ppo_clip | gspo | cispo, optionally TIS-weighted)
+ kl_loss_coef * kl_loss - entropy_coef * entropy.
"""

import math
from typing import Optional

import torch

from slime_hydra.algo.config import LOSS_AGGS, POLICY_LOSSES
from slime_hydra.algo.kl import compute_kl
from slime_hydra.algo.masked import as_bool_mask, masked_fill_zero, masked_mean, masked_sum

RATIO_LEVELS = ("token", "sequence")

Metrics = dict[str, torch.Tensor]


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, loss_agg: str,
              max_response_tokens: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar, over trained tokens only. With m the mask, B the batch rows:

        token_mean               sum_{i,t} m x / sum_{i,t} m        every token weighs the same (DAPO, "token-level
                                                                    policy gradient loss"): long answers weigh more
        seq_mean_token_mean      1/B sum_i (sum_t m x / sum_t m)    every sequence weighs the same (GRPO paper,
                                                                    GSPO); a token of a short answer weighs more
        seq_mean_token_sum       1/B sum_i sum_t m x                per-sequence sum, no length normalisation
        seq_mean_token_sum_norm  1/B sum_i sum_t m x / L            L = max_response_tokens, a constant (Dr.GRPO:
                                                                    = sum over all tokens / (B * L), no length bias)

    A fully-masked sequence contributes 0 and still counts in the seq_mean_* denominator B (matching the trainer's
    sequence units); a batch with no trained token at all gives 0 in every mode, never NaN.
    """
    if loss_agg == "token_mean":
        return masked_mean(per_token, loss_mask)
    if loss_agg == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, loss_mask, dim=1)
    elif loss_agg == "seq_mean_token_sum":
        per_seq = masked_sum(per_token, loss_mask, dim=1)
    elif loss_agg == "seq_mean_token_sum_norm":
        if max_response_tokens is None or max_response_tokens <= 0:
            raise ValueError(f"loss_agg=seq_mean_token_sum_norm divides by max_response_tokens, got "
                             f"{max_response_tokens!r}")
        per_seq = masked_sum(per_token, loss_mask, dim=1) / max_response_tokens
    else:
        raise ValueError(f"loss_agg={loss_agg!r} is not one of {LOSS_AGGS}")
    return per_seq.sum() / max(per_seq.shape[0], 1)


def _diagnostic(per_token: torch.Tensor, loss_mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """A detached mean of a diagnostic over the same units as ``loss_agg`` (tokens, or sequences)."""
    agg = "token_mean" if loss_agg == "token_mean" else "seq_mean_token_mean"
    per_token = per_token.detach()
    if per_token.dtype != torch.float64:
        per_token = per_token.float()  # bf16 means of fractions would be too coarse
    return aggregate(per_token, loss_mask, agg)


def _check_clip(eps_clip: float, eps_clip_high: Optional[float], eps_clip_c: Optional[float]) -> float:
    """Validate the clip ranges; returns the upper clip actually used."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip < 0 or high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_clip={eps_clip}, eps_clip_high={eps_clip_high}")
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c={eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3.0), or None to disable")
    return high


def _check_tis(tis_weights: Optional[torch.Tensor], like: torch.Tensor) -> None:
    if tis_weights is not None and tis_weights.shape != like.shape:
        raise ValueError(f"tis_weights has shape {tuple(tis_weights.shape)}, expected {tuple(like.shape)}")


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, loss_mask: torch.Tensor,
              ratio_level: str = "token") -> torch.Tensor:
    """log of the importance ratio per token, [B, T], 0 at masked positions.

    token:    log r_{i,t} = logp_{i,t} - old_logp_{i,t}
    sequence: log s_{i,t} = sg[log s_i] + logp_{i,t} - sg[logp_{i,t}],
              log s_i = (1 / |y_i|) sum_t m_{i,t} (logp_{i,t} - old_logp_{i,t})   (GSPO, Zheng et al. 2025)
    The sequence form has the value log s_i at every token of sample i and d s_{i,t} / d logp_{i,t} = s_i, which
    is the paper's "GSPO-token" construction: with an advantage constant over the sequence and seq_mean_token_mean
    aggregation its gradient equals the sequence-level one, A_i * grad s_i. |y_i| = trained tokens of sample i.
    """
    mask = as_bool_mask(loss_mask, logp)
    diff = masked_fill_zero(logp - old_logp, mask)
    if ratio_level == "token":
        return diff
    if ratio_level != "sequence":
        raise ValueError(f"ratio_level={ratio_level!r} is not one of {RATIO_LEVELS}")
    seq = masked_mean(diff, mask, dim=1).detach()
    return masked_fill_zero(seq.unsqueeze(1) + logp - logp.detach(), mask)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                  eps_clip: float = 0.2, eps_clip_high: Optional[float] = None, eps_clip_c: Optional[float] = None,
                  ratio_level: str = "token", loss_agg: str = "token_mean",
                  max_response_tokens: Optional[int] = None,
                  tis_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric clip and dual-clip; GSPO with ratio_level="sequence".

    Per trained token, with r the ratio from ``log_ratio`` (token or sequence level) and A the advantage:
        l1 = -A * r
        l2 = -A * clamp(r, 1 - eps_clip, 1 + eps_clip_high)       (eps_clip_high None: = eps_clip)
        l  = max(l1, l2)
        dual-clip (eps_clip_c = c > 1, Ye et al. 2020): for A < 0, l = min(l, -A * c)
        loss = aggregate(l * w, loss_mask, loss_agg)              w = tis_weights (detached), or 1
    Departures: DAPO's clip-higher is the eps_clip_high asymmetry; GSPO (ratio_level="sequence") clips the
    sequence ratio s_i, so one clip decision covers a whole sample, and the paper uses eps of ~3e-4 / 4e-4.
    Metrics: pg_loss (the loss), pg_clipfrac (share of tokens where l2 > l1, i.e. the clip is active; the
    dual-clip is not counted), ppo_kl (mean of old_logp - logp over tokens, whatever the ratio level).
    """
    high = _check_clip(eps_clip, eps_clip_high, eps_clip_c)
    _check_tis(tis_weights, logp)
    mask = as_bool_mask(loss_mask, logp)
    ratio = torch.exp(log_ratio(logp, old_logp, mask, ratio_level))
    advantages = advantages.detach()
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(l1, l2)
    if eps_clip_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * eps_clip_c), per_token)
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach()
    loss = aggregate(per_token, mask, loss_agg, max_response_tokens)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": _diagnostic((l2 > l1).to(logp.dtype), mask, loss_agg),
        "ppo_kl": _diagnostic(old_logp - logp, mask, loss_agg),
    }
    return loss, metrics


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *,
               eps_clip: float = 0.2, eps_clip_high: Optional[float] = None, loss_agg: str = "token_mean",
               max_response_tokens: Optional[int] = None,
               tis_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    Per trained token, r = exp(logp - old_logp):
        l = -sg[clamp(r, 1 - eps_clip, 1 + eps_clip_high)] * A * logp        (eps_clip_high None: = eps_clip)
        loss = aggregate(l * w, loss_mask, loss_agg)                         w = tis_weights (detached), or 1
    so grad l = -clamp(r) * A * grad logp: no token is dropped from the gradient, unlike PPO's clip. The lower
    bound is eps_clip and the upper eps_clip_high, the paper's eps_low^IS / eps_high^IS. The paper effectively
    disables the lower bound (a large eps_low) and tunes only the upper one: eps_clip=1.0 does that here (r > 0).
    The paper normalises by the total token count: use loss_agg="token_mean". The loss *value* (sum of
    -w A logp) is not a surrogate of anything; only its gradient is meaningful.
    Metrics: pg_loss, pg_clipfrac (share of tokens with r outside [1 - eps_clip, 1 + eps_clip_high]), ppo_kl.
    """
    high = _check_clip(eps_clip, eps_clip_high, None)
    _check_tis(tis_weights, logp)
    mask = as_bool_mask(loss_mask, logp)
    ratio = torch.exp(log_ratio(logp, old_logp, mask, "token")).detach()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = -weight * advantages.detach() * masked_fill_zero(logp, mask)
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach()
    loss = aggregate(per_token, mask, loss_agg, max_response_tokens)
    clipped = (ratio < 1.0 - eps_clip) | (ratio > 1.0 + high)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": _diagnostic(clipped.to(logp.dtype), mask, loss_agg),
        "ppo_kl": _diagnostic(old_logp - logp, mask, loss_agg),
    }
    return loss, metrics


@torch.no_grad()
def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                         tis_cap: float, loss_agg: str = "token_mean") -> tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training") between the trainer's old policy and the inference engine that sampled.

        w_t = min(exp(old_logp_t - rollout_logp_t), tis_cap)   per trained token, detached; 1 at masked positions

    The weights multiply the per-token policy-gradient loss only (not the KL or entropy terms). Only the upper
    side is truncated. Returns (weights [B, T], metrics): tis (mean weight after truncation) and tis_clipfrac
    (share of tokens whose weight exceeded tis_cap).
    """
    if tis_cap <= 0:
        raise ValueError(f"tis_cap={tis_cap} must be > 0 (e.g. 2.0), or None to disable TIS")
    mask = as_bool_mask(loss_mask, old_logp)
    raw = torch.exp(masked_fill_zero(old_logp - rollout_logp, mask))
    weights = raw.clamp(max=tis_cap)
    metrics = {
        "tis": _diagnostic(weights, mask, loss_agg),
        "tis_clipfrac": _diagnostic((raw > tis_cap).to(raw.dtype), mask, loss_agg),
    }
    return weights, metrics


def masked_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                      mis_cap: float, loss_agg: str = "token_mean") -> tuple[torch.Tensor, Metrics]:
    """Masked importance sampling (token-level MIS, as in verl's rollout correction): the tokens whose trainer/engine
    ratio is implausible drop out of the policy-gradient loss, where TIS would only cap them.

        w_t = 1 if 1 / mis_cap <= exp(old_logp_t - rollout_logp_t) <= mis_cap, else 0     (detached; 1 at masked slots)

    The weights multiply the per-token policy-gradient loss only, so aggregation still counts the dropped tokens
    (the loss is not renormalized). Metrics: mis_maskfrac (share of trained tokens dropped).
    """
    if mis_cap <= 1:
        raise ValueError(f"mis_cap={mis_cap} must be > 1 (e.g. 2.0), or None to disable MIS")
    mask = as_bool_mask(loss_mask, old_logp)
    log_ratio = masked_fill_zero(old_logp - rollout_logp, mask).detach()
    keep = log_ratio.abs() <= math.log(mis_cap)
    weights = keep.to(old_logp.dtype)
    return weights, {"mis_maskfrac": _diagnostic((~keep).to(old_logp.dtype), mask, loss_agg)}


def rollout_mismatch(logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                     loss_agg: str = "token_mean") -> Metrics:
    """How far the trainer's logprobs of the sampled tokens are from the engine's that sampled them (both of the
    temperature-scaled distribution), per trained token with d_t = logp_t - rollout_logp_t:

        train_rollout_logprob_abs_diff      mean |d_t|               (over loss_agg's units, like every diagnostic)
        train_rollout_logprob_abs_diff_max  max |d_t|                (a ``_max`` metric: reduced by max, not mean)
        train_rollout_ratio_abs_dev         mean |exp(d_t) - 1|      (the spread of the importance ratio around 1)

    0 when trainer and engine compute the same distribution (the CPU fp32 path agrees to ~1e-6); bf16 kernels,
    stale weights or a different sampling distribution show here first. Diagnostics only (detached)."""
    mask = as_bool_mask(loss_mask, logp)
    diff = masked_fill_zero(logp.detach().float() - rollout_logp.float(), mask)
    return {"train_rollout_logprob_abs_diff": _diagnostic(diff.abs(), mask, loss_agg),
            "train_rollout_logprob_abs_diff_max": diff.abs().max() if diff.numel() else diff.sum(),
            "train_rollout_ratio_abs_dev": _diagnostic((torch.exp(diff) - 1).abs(), mask, loss_agg)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor, *,
               value_clip: Optional[float] = 0.2, loss_agg: str = "token_mean",
               max_response_tokens: Optional[int] = None) -> tuple[torch.Tensor, Metrics]:
    """PPO critic loss with value clipping, per trained token:

        v_clip = old_V + clamp(V - old_V, -value_clip, value_clip)
        l      = 0.5 * max((V - R)^2, (v_clip - R)^2)                  (value_clip None: 0.5 * (V - R)^2)
        loss   = aggregate(l, loss_mask, loss_agg)
    V = ``values`` (with gradient), old_V = ``old_values`` (the critic at rollout time), R = ``returns`` (GAE
    targets). The max makes the clip pessimistic, as in the PPO2 reference implementation (not in the PPO paper).
    Metrics: value_loss, value_clipfrac (share of tokens where the clipped error is the larger one).
    """
    mask = as_bool_mask(loss_mask, values)
    returns = returns.detach()
    unclipped = (values - returns).square()
    if value_clip is None:
        per_token, clipped = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        old_values = old_values.detach()
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_err = (v_clip - returns).square()
        per_token, clipped = 0.5 * torch.maximum(unclipped, clipped_err), clipped_err > unclipped
    loss = aggregate(per_token, mask, loss_agg, max_response_tokens)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": _diagnostic(clipped.to(values.dtype), mask, loss_agg)}


def entropy_loss(entropy: torch.Tensor, loss_mask: torch.Tensor, *, entropy_coef: float,
                 loss_agg: str = "token_mean",
                 max_response_tokens: Optional[int] = None) -> tuple[torch.Tensor, Metrics]:
    """Entropy bonus: loss = -entropy_coef * aggregate(H, loss_mask, loss_agg).

    ``entropy`` [B, T] is the entropy of the policy's next-token distribution at each response position (nats,
    computed by the trainer from the full logits). Metric entropy_loss = aggregate(H) (the entropy itself,
    positive, as slime logs it), not the signed term.
    """
    mean_entropy = aggregate(entropy, loss_mask, loss_agg, max_response_tokens)
    return -entropy_coef * mean_entropy, {"entropy_loss": mean_entropy.detach()}


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, *, loss_agg: str = "token_mean",
             max_response_tokens: Optional[int] = None) -> tuple[torch.Tensor, Metrics]:
    """Supervised fine-tuning: masked negative log-likelihood, loss = aggregate(-logp, loss_mask, loss_agg)."""
    loss = aggregate(-logp, loss_mask, loss_agg, max_response_tokens)
    return loss, {"sft_loss": loss.detach()}


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor, *, kl_loss_type: str,
            kl_loss_coef: float, loss_agg: str = "token_mean",
            max_response_tokens: Optional[int] = None) -> tuple[torch.Tensor, Metrics]:
    """KL penalty in the loss (GRPO): loss = kl_loss_coef * aggregate(kl, loss_mask, loss_agg).

    kl = ``compute_kl(logp, ref_logp, mask, kl_loss_type=...)`` per token, with the gradient through ``logp``
    (ref_logp is detached). Metric kl_loss = aggregate(kl), without the coefficient. This is the *loss term*;
    reward shaping with a KL (``kl_coef``) happens in the advantage estimators instead.
    """
    kl = compute_kl(logp, ref_logp.detach(), loss_mask, kl_loss_type=kl_loss_type)
    mean_kl = aggregate(kl, loss_mask, loss_agg, max_response_tokens)
    return kl_loss_coef * mean_kl, {"kl_loss": mean_kl.detach()}


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, *, policy_loss: str = "ppo_clip",
                        ref_logp: Optional[torch.Tensor] = None, rollout_logp: Optional[torch.Tensor] = None,
                        entropy: Optional[torch.Tensor] = None, eps_clip: float = 0.2,
                        eps_clip_high: Optional[float] = None, eps_clip_c: Optional[float] = None,
                        kl_loss_coef: float = 0.0, kl_loss_type: str = "low_var_kl", kl_coef: float = 0.0,
                        entropy_coef: float = 0.0, tis_cap: Optional[float] = None, mis_cap: Optional[float] = None,
                        loss_agg: str = "token_mean",
                        max_response_tokens: Optional[int] = None) -> tuple[torch.Tensor, Metrics]:
    """The actor's loss: pg + kl_loss_coef * KL(pi || ref) - entropy_coef * H, every term aggregated by loss_agg.

        pg = ppo_clip_loss (policy_loss="ppo_clip": token ratio; "gspo": sequence ratio) or cispo_loss ("cispo"),
             each token's pg loss multiplied by truncated_is_weights(old_logp, rollout_logp) when tis_cap is set
             and by masked_is_weights when mis_cap is set (both: the product).

    ``kl_coef`` is accepted only to refuse it next to ``kl_loss_coef``: the KL is either shaped into the reward
    (kl_coef, in the advantages) or added to the loss (kl_loss_coef), never both. ``ref_logp`` is needed when
    kl_loss_coef > 0 (given with kl_loss_coef = 0, the KL is only reported), ``rollout_logp`` when tis_cap is set,
    ``entropy`` when entropy_coef != 0 (given with entropy_coef = 0, it is only reported).

    Metrics (slime's names): pg_loss, pg_clipfrac, ppo_kl; kl_loss when ref_logp is given; entropy_loss when
    entropy is given; tis, tis_clipfrac when tis_cap is set; mis_maskfrac when mis_cap is set.
    """
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={policy_loss!r} is not one of {POLICY_LOSSES}")
    if kl_coef > 0 and kl_loss_coef > 0:
        raise ValueError(f"kl_coef={kl_coef} (reward shaping) and kl_loss_coef={kl_loss_coef} (loss term) are both "
                         f"> 0: use one KL penalty, set the other to 0")
    if kl_loss_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_loss_coef={kl_loss_coef} needs the reference policy's logprobs (ref_logp)")
    if (tis_cap is not None or mis_cap is not None) and rollout_logp is None:
        raise ValueError(f"tis_cap={tis_cap} / mis_cap={mis_cap} need the rollout engine's logprobs (rollout_logp)")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy")

    metrics: Metrics = {}
    tis_weights = None
    if tis_cap is not None:
        tis_weights, tis_metrics = truncated_is_weights(old_logp, rollout_logp, loss_mask, tis_cap=tis_cap,
                                                        loss_agg=loss_agg)
        metrics.update(tis_metrics)
    if mis_cap is not None:
        mis_weights, mis_metrics = masked_is_weights(old_logp, rollout_logp, loss_mask, mis_cap=mis_cap,
                                                     loss_agg=loss_agg)
        metrics.update(mis_metrics)
        tis_weights = mis_weights if tis_weights is None else tis_weights * mis_weights
    if policy_loss == "cispo":
        loss, pg_metrics = cispo_loss(logp, old_logp, advantages, loss_mask, eps_clip=eps_clip,
                                      eps_clip_high=eps_clip_high, loss_agg=loss_agg,
                                      max_response_tokens=max_response_tokens, tis_weights=tis_weights)
    else:
        loss, pg_metrics = ppo_clip_loss(logp, old_logp, advantages, loss_mask, eps_clip=eps_clip,
                                         eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c,
                                         ratio_level="sequence" if policy_loss == "gspo" else "token",
                                         loss_agg=loss_agg, max_response_tokens=max_response_tokens,
                                         tis_weights=tis_weights)
    metrics.update(pg_metrics)
    if ref_logp is not None:
        kl_term, kl_metrics = kl_loss(logp, ref_logp, loss_mask, kl_loss_type=kl_loss_type,
                                      kl_loss_coef=kl_loss_coef, loss_agg=loss_agg,
                                      max_response_tokens=max_response_tokens)
        metrics.update(kl_metrics)
        if kl_loss_coef != 0:
            loss = loss + kl_term
    if entropy is not None:
        ent_term, ent_metrics = entropy_loss(entropy, loss_mask, entropy_coef=entropy_coef, loss_agg=loss_agg,
                                             max_response_tokens=max_response_tokens)
        metrics.update(ent_metrics)
        if entropy_coef != 0:
            loss = loss + ent_term
    return loss, metrics
