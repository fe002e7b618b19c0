"""Algo group schema: advantage estimator, policy loss, KL, clipping and the DAPO-style tricks.

The algo options (``conf/algo/``) are named recipes of these fields:

| option | advantage_estimator | policy_loss | notable deltas |
|---|---|---|---|
| grpo | grpo | ppo_clip | kl_loss_coef 0.001 (k3 against the reference) |
| gspo | grpo | gspo | sequence-level ratio, tight clip (3e-4 / 4e-4) |
| cispo | grpo | cispo | clipped, stop-gradient IS weight on logp |
| dr_grpo | grpo | ppo_clip | no std normalisation, seq_mean_token_sum_norm |
| dapo | grpo | ppo_clip | clip-higher 0.28, token_mean, nonzero_std dynamic filter, overlong penalty |
| reinforce_pp | reinforce_pp | ppo_clip | kl_coef reward shaping, global whitening |
| reinforce_pp_baseline | reinforce_pp_baseline | ppo_clip | group-mean baseline, whitening |
| ppo | gae | ppo_clip | critic (value head), gamma / lam |
"""

from dataclasses import dataclass
from typing import Optional

GROUP_ESTIMATORS = ("grpo", "reinforce_pp_baseline")
"""Estimators whose baseline is the group of samples of one prompt: they need n_samples_per_prompt > 1."""


@dataclass
class AlgoConfig:
    name: str = "grpo"
    """The conf/algo option this came from (used in run names and logs)."""
    advantage_estimator: str = "grpo"
    """grpo | reinforce_pp | reinforce_pp_baseline | gae (PPO with a critic)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip (token ratio) | gspo (sequence ratio) | cispo (clipped stop-gradient IS weight)."""
    std_normalization: bool = True
    """GRPO: divide the group-centred reward by the group std (Dr.GRPO turns it off)."""
    normalize_advantages: bool = False
    """Whiten advantages over the whole batch under the loss mask (REINFORCE++ always whitens)."""
    eps_clip: float = 0.2
    """Lower PPO clip: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: Optional[float] = None
    """Upper PPO clip (DAPO clip-higher, e.g. 0.28); null means eps_clip."""
    eps_clip_c: Optional[float] = None
    """Dual-clip bound (> 1, e.g. 3.0) capping the loss of negative-advantage tokens; null disables."""
    kl_loss_coef: float = 0.0
    """Weight of the KL(policy || reference) loss term; 0 disables. Exclusive with kl_coef."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10])."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty subtracted from the reward (reward shaping); 0 disables."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (Dr.GRPO: / max tokens)."""
    gamma: float = 1.0
    """Discount per token for REINFORCE++ returns and GAE."""
    lam: float = 1.0
    """GAE lambda."""
    value_clip: float = 0.2
    """PPO value-loss clip range around the old value."""
    value_loss_coef: float = 0.5
    """Weight of the critic's value loss (PPO only)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling between trainer-old and rollout logprobs: clamp of the weight (e.g. 2.0); null off."""
    dynamic_filter: Optional[str] = None
    """Group filter for dynamic sampling: nonzero_std (DAPO) or a dotted path to fn(group) -> bool | (bool, reason)."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong punishment: the last N tokens before max_response_tokens are penalised linearly; 0 off."""
    overlong_penalty: float = 1.0
    """Reward subtracted at the hard limit by the overlong punishment (linear from 0 over the buffer)."""

    @property
    def clip_high(self) -> float:
        """Upper clip actually used."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        """A reference policy is kept only when a KL term uses it."""
        return self.kl_loss_coef > 0 or self.kl_coef > 0

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator == "gae"
