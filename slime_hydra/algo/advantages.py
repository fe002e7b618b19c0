"""Advantage estimators: sequence rewards (and a critic's values) -> per-token advantages under the loss mask.

Shapes: ``rewards`` [B] (one scalar per sample), token tensors [B, T] over response positions, ``loss_mask`` [B, T]
nonzero on trained tokens. Samples are group-contiguous: rows [g * group_size, (g + 1) * group_size) answer prompt g.
Every estimator runs without autograd and returns detached tensors that are exactly 0 at masked positions.

Estimators (``compute_advantages(estimator, ...)``):

    grpo                   A_i = (r_i - mean_group(r)) / (std_group(r) + eps), broadcast to the sample's tokens
    reinforce_pp           G_t = sum_{k >= t} gamma^(k - t) rho_k  with  rho_k = -kl_coef * kl_k  + r_i [k = last],
                           then A = whiten(G) over the whole batch
    reinforce_pp_baseline  as reinforce_pp with r_i replaced by r_i - mean_group(r)
    gae                    PPO: delta_t = rho_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},
                           returns_t = A_t + V_t (the critic's targets)

GSPO, CISPO, Dr.GRPO and DAPO all use the grpo estimator; they differ in the policy loss, the loss aggregation,
(Dr.GRPO) ``std_normalization=False``, and (DAPO) ``overlong_penalty``, a length term added to the reward first.

Masked positions inside a response (tool output in a multi-turn sample) are not steps of the policy: the
right-to-left recursions (returns, GAE) skip them, as if those columns were removed, so gamma and lam discount
per *trained* token. "last" is the last trained token of the sample; a sample with no trained token gets all zeros.
"""

from typing import Optional

import torch

from slime_hydra.algo.config import ADVANTAGE_ESTIMATORS
from slime_hydra.algo.masked import as_bool_mask, masked_fill_zero, masked_mean


_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] -> [B / group_size, group_size], with the checks every group estimator needs."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group baseline needs at least 2 samples per prompt")
    if rewards.shape[0] % group_size:
        raise ValueError(f"batch of {rewards.shape[0]} samples is not a whole number of groups of {group_size}")
    return _as_float(rewards).reshape(-1, group_size)


def _as_float(rewards: torch.Tensor) -> torch.Tensor:
    """Integer or bool rewards (0/1 correctness) as float32; float rewards keep their dtype."""
    return rewards if rewards.is_floating_point() else rewards.float()


def _broadcast(per_sample: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sample's value on each of its trained tokens, 0 elsewhere."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != per_sample.shape[0]:
        raise ValueError(f"loss_mask must be [B={per_sample.shape[0]}, T], got shape {tuple(loss_mask.shape)}")
    values = per_sample.unsqueeze(1).expand(loss_mask.shape)
    return masked_fill_zero(values, loss_mask)


def whiten(x: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Global whitening under the mask: (x - mu) / sqrt(var + eps), 0 at masked positions.

    mu = sum(m x) / sum(m) and var = sum(m (x - mu)^2) / sum(m) over every trained token of the batch (the
    population variance: no Bessel correction). Constant inputs give exactly 0, never NaN; an all-masked input
    gives all zeros.
    """
    mean = masked_mean(x, loss_mask)
    centred = x - mean
    var = masked_mean(centred.square(), loss_mask)
    return masked_fill_zero(centred * torch.rsqrt(var + eps), loss_mask)


@torch.no_grad()
def group_normalized_rewards(rewards: torch.Tensor, *, group_size: int, std_normalization: bool = True,
                             eps: float = 1e-6) -> torch.Tensor:
    """GRPO's per-sample score, [B]: (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std normalisation.

    std_g is the sample standard deviation of the group (Bessel-corrected, divisor group_size - 1, as in the
    DeepSeekMath GRPO formula and torch.std). A group whose rewards are all equal gives 0 for each of its samples
    (0 / (0 + eps)), never NaN. Dr.GRPO (Liu et al. 2025) sets std_normalization=False: dividing by the std
    up-weights prompts that are nearly always or never solved.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std_normalization:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


@torch.no_grad()
def grpo_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor, *, group_size: int,
                    std_normalization: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages, [B, T]: ``group_normalized_rewards`` broadcast to every trained token.

    A_{i,t} = (r_i - mean_g(r)) / (std_g(r) + eps) for each t with m_{i,t} != 0, 0 elsewhere. The paper's eps is
    unspecified; 1e-6 here. Also the advantage of GSPO, CISPO, Dr.GRPO (std_normalization=False) and DAPO.
    """
    scores = group_normalized_rewards(rewards, group_size=group_size, std_normalization=std_normalization, eps=eps)
    return _broadcast(scores, loss_mask)


@torch.no_grad()
def shaped_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, *, kl_coef: float = 0.0,
                         kl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token rewards, [B, T]: rho_{i,t} = -kl_coef * kl_{i,t} + r_i * [t is the last trained token of i].

    ``kl`` is a per-token KL estimate [B, T] between the policy that sampled the tokens and the reference
    (usually ``compute_kl(old_logp, ref_logp, mask, kl_loss_type="k1")``, as in InstructGPT/REINFORCE++); it is
    required when kl_coef != 0. Samples with no trained token get all zeros (their reward is dropped).
    """
    if rewards.dim() != 1 or loss_mask.dim() != 2 or rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"rewards [B] and loss_mask [B, T] disagree: {tuple(rewards.shape)} vs "
                         f"{tuple(loss_mask.shape)}")
    rewards = _as_float(rewards)
    mask = loss_mask != 0
    b, t = mask.shape
    cols = torch.arange(t, device=mask.device).expand(b, t)
    last = torch.where(mask, cols, torch.full_like(cols, -1)).amax(dim=1)
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has_token = last >= 0
    rows = torch.arange(b, device=mask.device)[has_token]
    token_rewards[rows, last[has_token]] = rewards[has_token]
    if kl_coef != 0.0:
        if kl is None:
            raise ValueError(f"kl_coef={kl_coef} shapes the reward with a per-token KL, but kl is None")
        token_rewards = token_rewards - kl_coef * masked_fill_zero(kl.to(token_rewards.dtype), mask)
    return token_rewards


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go, [B, T]: G_t = rho_t + gamma * G_{t'} with t' the next trained token after t (G = 0 past the end).

    Runs right to left over trained tokens only; masked positions keep G and output 0. gamma = 1 makes G_t the
    plain sum of the remaining trained-token rewards.
    """
    mask = as_bool_mask(loss_mask, token_rewards)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return returns


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float = 1.0,
                            kl_coef: float = 0.0, kl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025), [B, T]: A = whiten(discounted_returns(shaped_token_rewards(r, kl_coef, kl), gamma)).

    The baseline is the batch-wide whitening (mean over every trained token of the batch), not a critic or a
    group. Whitening always applies; it is what makes this estimator REINFORCE++ rather than plain REINFORCE.
    """
    token_rewards = shaped_token_rewards(rewards, loss_mask, kl_coef=kl_coef, kl=kl)
    return whiten(discounted_returns(token_rewards, loss_mask, gamma=gamma), loss_mask)


@torch.no_grad()
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor, *, group_size: int,
                                     gamma: float = 1.0, kl_coef: float = 0.0,
                                     kl: Optional[torch.Tensor] = None) -> torch.Tensor:
    """REINFORCE++-baseline, [B, T]: ``reinforce_pp_advantages`` of the group-centred rewards r_i - mean_g(r).

    The group mean removes the prompt's difficulty before the batch whitening; there is no std division per group
    (the global whitening scales instead). A group whose rewards are all equal contributes returns of 0 (plus any
    KL shaping) before whitening.
    """
    centred = group_normalized_rewards(rewards, group_size=group_size, std_normalization=False)
    return reinforce_pp_advantages(centred, loss_mask, gamma=gamma, kl_coef=kl_coef, kl=kl)


@torch.no_grad()
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over trained tokens -> (advantages, returns), [B, T].

    Right to left over the trained tokens of each sample, with t' the next trained token after t:
        delta_t = rho_t + gamma * V_{t'} - V_t          (V_{t'} = 0 past the last trained token: terminal state)
        A_t     = delta_t + gamma * lam * A_{t'}        (A_{t'} = 0 past the end)
        R_t     = A_t + V_t                             (the value targets)
    ``token_rewards`` rho [B, T] (see ``shaped_token_rewards``), ``values`` V [B, T] from the critic before each
    response token. Both outputs are 0 at masked positions. No whitening here (``normalize_advantages`` does it).
    """
    mask = as_bool_mask(loss_mask, token_rewards)
    if values.shape != token_rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} and token_rewards {tuple(token_rewards.shape)} differ")
    values = values.to(token_rewards.dtype)
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(m, adv, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = torch.where(m, adv, torch.zeros_like(adv))
    returns = masked_fill_zero(advantages + values, mask)
    return advantages, returns


@torch.no_grad()
def overlong_penalty(response_lengths: torch.Tensor, *, max_response_tokens: int, buffer_tokens: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a reward term [B] <= 0 for responses that run into
    the last ``buffer_tokens`` of the budget, added to the task reward before the advantages.
    With L = response length, L_max = max_response_tokens, L_buf = buffer_tokens::

        0                                            L <= L_max - L_buf
        -penalty * (L - (L_max - L_buf)) / L_buf     L_max - L_buf < L <= L_max
        -penalty                                     L > L_max

    Departure: the paper's scale is 1; ``penalty`` (algo.overlong_penalty) scales it."""
    if not 0 < buffer_tokens < max_response_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens} must lie in (0, max_response_tokens={max_response_tokens})")
    start = max_response_tokens - buffer_tokens
    over = (response_lengths.to(torch.float64) - start).clamp(min=0) / buffer_tokens
    return -penalty * over.clamp(max=1.0)


def compute_advantages(estimator: str, *, rewards: torch.Tensor, loss_mask: torch.Tensor,
                       group_size: Optional[int] = None, std_normalization: bool = True, gamma: float = 1.0,
                       lam: float = 1.0, kl_coef: float = 0.0, kl: Optional[torch.Tensor] = None,
                       values: Optional[torch.Tensor] = None,
                       normalize_advantages: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``estimator`` (the ``advantage_estimator`` config key) -> (advantages, returns), both [B, T].

    grpo                  ``grpo_advantages``; needs group_size. returns = the advantages.
    reinforce_pp          ``reinforce_pp_advantages``; returns = the discounted returns before whitening.
    reinforce_pp_baseline ``reinforce_pp_baseline_advantages``; needs group_size; returns as reinforce_pp.
    gae                   ``gae_advantages`` on ``shaped_token_rewards(rewards, kl_coef, kl)``; needs ``values``;
                          returns = the critic's value targets.
    ``kl`` [B, T] is the per-token KL used by reward shaping (needed when kl_coef != 0; grpo does no reward
    shaping and rejects kl_coef != 0). normalize_advantages whitens the advantages over the whole batch under the
    mask (a no-op on the reinforce_pp estimators, which always whiten).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {ADVANTAGE_ESTIMATORS}")
    if estimator in ("grpo", "reinforce_pp_baseline") and group_size is None:
        raise ValueError(f"the {estimator} estimator needs group_size (samples per prompt)")
    if estimator == "grpo":
        if kl_coef != 0.0:
            raise ValueError(f"kl_coef={kl_coef}: grpo does no reward shaping; use kl_loss_coef for a KL term")
        advantages = grpo_advantages(rewards, loss_mask, group_size=group_size, std_normalization=std_normalization)
        returns = advantages
    elif estimator == "gae":
        if values is None:
            raise ValueError("the gae estimator needs the critic's values [B, T]")
        token_rewards = shaped_token_rewards(rewards, loss_mask, kl_coef=kl_coef, kl=kl)
        advantages, returns = gae_advantages(token_rewards, values, loss_mask, gamma=gamma, lam=lam)
    else:
        if estimator == "reinforce_pp_baseline":
            rewards = group_normalized_rewards(rewards, group_size=group_size, std_normalization=False)
        returns = discounted_returns(shaped_token_rewards(rewards, loss_mask, kl_coef=kl_coef, kl=kl), loss_mask,
                                     gamma=gamma)
        advantages = whiten(returns, loss_mask)
    if normalize_advantages and estimator not in _WHITENED:
        advantages = whiten(advantages, loss_mask)
    return advantages, returns
