"""The rules of the objectives that train on the data's responses (algo.objective=sft, dpo): nothing is sampled, so
what only sampling or the policy-gradient step uses is refused, by key (config/rules.py runs ``check_objective``).

    sft    each row's one response, the mean NLL of its tokens
    dpo    each row's chosen and rejected responses, two samples a row (rollout.n_samples_per_prompt=2), DPO's loss
           of the pair, which needs the sequence sums of loss_agg=seq_mean_token_sum and one optimizer step a batch
           (its weights come from the policy before the step: train/prepare.dpo_weights)
"""

from typing import Iterator

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.config.derive import Derived
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem

POLICY_GRADIENT_ONLY = ("advantage_estimator", "policy_loss", "std_normalization", "normalize_advantages",
                        "eps_clip", "eps_clip_high", "eps_clip_c", "kl_loss_coef", "kl_loss_type", "kl_coef",
                        "entropy_coef", "gamma", "lam", "value_clip", "value_loss_coef", "tis_cap", "mis_cap",
                        "routing_replay", "dynamic_filter", "overlong_buffer_tokens", "overlong_penalty")
"""The algo fields only the policy-gradient step reads: algo.objective=sft and dpo refuse them set."""
SAMPLES_PER_ROW = {"sft": 1, "dpo": 2}
"""rollout.n_samples_per_prompt of each objective that trains on the data: its responses per row."""


def check_objective(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """algo.objective=sft and dpo train each data row's responses, in the data's order, one batch a step: what only
    sampling uses (other sample counts, rollouts ahead, over-sampling, adaptive prompts, the debug modes of saved
    rollouts, a sync schedule: the weights go to the engines before each eval) and the policy-gradient fields would
    do nothing, so they are refused, by key; dpo also needs its loss aggregation and one optimizer step a batch."""
    objective = cfg.algo.objective
    if not cfg.algo.from_data:
        return
    default, why = AlgoConfig(), f"algo.objective={objective} trains on the data's responses"
    for name in POLICY_GRADIENT_ONLY:
        if getattr(cfg.algo, name) != getattr(default, name):
            yield Problem((f"algo.{name}", "algo.objective"), f"{why}: algo.{name}, a policy-gradient setting, "
                          "would do nothing", f"leave algo.{name} at its default ({getattr(default, name)})")
    r, n = cfg.rollout, SAMPLES_PER_ROW[objective]
    for keys, setting, fix in (
            ("rollout.n_samples_per_prompt", r.n_samples_per_prompt != n, f"set rollout.n_samples_per_prompt={n} "
             f"(or use recipes=tiny_{objective}_cpu)"),
            ("mode", cfg.mode != "sync", "set mode=sync"),
            ("rollout.over_sampling_batch_prompts", r.over_sampling_batch_prompts is not None,
             "set rollout.over_sampling_batch_prompts=null"),
            ("data.adaptive.enabled", cfg.data.adaptive.enabled, "set data.adaptive.enabled=false"),
            ("rollout.temperature", r.temperature != 1.0, "set rollout.temperature=1.0 (the trainer would scale the "
             "logits by it; the evals have their own)"),
            ("debug.mode", cfg.debug.mode != "none", "set debug.mode=none"),
            ("sync_every_steps", cfg.sync_every_steps != 1, "set sync_every_steps=1 (the engines get the weights "
             "before each eval)")):
        if setting:
            yield Problem((keys, "algo.objective"), f"{why}, {n} response{'s' if n > 1 else ''} a row, none sampled: "
                          f"{keys} is for sampled rollouts", fix)
    if objective != "dpo":
        return
    if cfg.algo.loss_agg != "seq_mean_token_sum":
        yield Problem(("algo.loss_agg", "algo.objective"), f"DPO's loss sums each response's logprobs, and "
                      f"loss_agg={cfg.algo.loss_agg} would weigh them otherwise", "set algo.loss_agg=seq_mean_token_sum")
    if d.optimizer_steps_per_rollout != 1:
        yield Problem(("train.optimizer_steps_per_rollout", "algo.objective"), "algo=dpo takes one optimizer step a "
                      f"batch (its weights are the policy's before it), not {d.optimizer_steps_per_rollout}",
                      "set train.optimizer_steps_per_rollout=1")
