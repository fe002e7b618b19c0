"""RL algorithms as pure torch functions over padded [B, T] response tensors, each with its formula in the docstring.

kl.py          compute_kl (k1 | k2 | k3 | low_var_kl)
advantages.py  compute_advantages (grpo | reinforce_pp | reinforce_pp_baseline | gae), grpo_advantages,
               group_normalized_rewards, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
               gae_advantages, shaped_token_rewards, discounted_returns, whiten, overlong_penalty (DAPO)
losses.py      compute_policy_loss (ppo_clip | gspo | cispo, + KL loss, entropy, TIS), ppo_clip_loss, cispo_loss,
               truncated_is_weights, masked_is_weights, rollout_mismatch, value_loss, entropy_loss, sft_loss, kl_loss, log_ratio,
               aggregate
masked.py      masked_mean, masked_sum (reductions that ignore padded slots, never NaN)
config.py      AlgoConfig, the algo group's schema, and the names each choice accepts (ADVANTAGE_ESTIMATORS,
               POLICY_LOSSES, KL_TYPES, LOSS_AGGS), which the functions above import

Names are imported lazily (PEP 562), so ``slime_hydra.algo.config`` can be loaded by the launcher without torch.
"""

import importlib

_EXPORTS = {
    "config": ("AlgoConfig", "ADVANTAGE_ESTIMATORS", "KL_TYPES", "LOSS_AGGS", "POLICY_LOSSES"),
    "kl": ("compute_kl",),
    "advantages": ("compute_advantages", "grpo_advantages", "group_normalized_rewards", "reinforce_pp_advantages",
                   "reinforce_pp_baseline_advantages", "gae_advantages", "shaped_token_rewards",
                   "discounted_returns", "whiten", "overlong_penalty"),
    "losses": ("compute_policy_loss", "ppo_clip_loss", "cispo_loss", "truncated_is_weights", "value_loss",
               "entropy_loss", "sft_loss", "kl_loss", "log_ratio", "aggregate", "rollout_mismatch", "masked_is_weights"),
    "masked": ("masked_mean", "masked_sum"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
