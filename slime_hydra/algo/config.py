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
| sft | - | - | ``objective: sft``: the data's responses, mean NLL of their tokens (no sampling, no reward) |
| opd | grpo | ppo_clip | ``objective: opd``: on-policy distillation, a teacher scores every sampled token |
| dpo | - | - | ``objective: dpo``: the data's chosen and rejected responses, DPO's loss against the reference |
"""

from dataclasses import dataclass, field
from typing import Iterator, Optional

from slime_hydra.options import Problem, choice, non_negative, within

OBJECTIVES = ("policy_gradient", "sft", "opd", "dpo")
"""algo.objective: what a step trains on and how (loop.Session.train_phase, train/objectives.py)."""
ADVANTAGE_ESTIMATORS = ("grpo", "reinforce_pp", "reinforce_pp_baseline", "gae")
"""algo.advantage_estimator: names ``algo/advantages.compute_advantages`` accepts."""
GROUP_ESTIMATORS = ("grpo", "reinforce_pp_baseline")
"""Estimators whose baseline is the group of samples of one prompt: they need n_samples_per_prompt > 1."""
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
"""algo.policy_loss: names ``algo/losses.compute_policy_loss`` accepts."""
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
"""algo.kl_loss_type: names ``algo/kl.compute_kl`` accepts."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""algo.loss_agg: names ``algo/losses.aggregate`` accepts."""


@dataclass
class TeacherConfig:
    """algo.objective=opd: on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025). The student samples
    with the engines, the teacher scores each sampled token, and the advantage of token t is

        A_t = reward_weight * A_t(advantage_estimator) - kl_coef * (log pi_student(y_t) - log pi_teacher(y_t))

    the second term a one-sample estimate of the reverse KL(student || teacher) at that token (train/prepare.py);
    pi_student is the policy that sampled (the trainer's old logprobs when computed, else the engine's)."""

    path: Optional[str] = None
    """The teacher: an HF checkpoint directory, or the name of a conf/model option (its model.path, or, where that is
    null, its build offline as model=tiny's, model/teacher.py). Its tokenizer must be the student's."""
    kl_coef: float = non_negative(1.0)
    """Weight of the per-token reverse KL to the teacher in the advantage (slime's --opd-kl-coef)."""
    reward_weight: float = non_negative(0.0)
    """Weight of the advantage estimator's task-reward advantage mixed in; 0 distills only (the reward is still
    scored and logged)."""


@dataclass
class DpoConfig:
    """algo.objective=dpo: direct preference optimization (Rafailov et al. 2023) on the data's pairs. With
    s(y) = log pi(y | x) - log pi_ref(y | x) (sums over the response's tokens, EOS included) and
    z = beta (s(chosen) - s(rejected)), the loss of a pair is -log sigmoid(z) (train/prepare.dpo_weights)."""

    beta: float = within(0.1, 0, low_open=True)
    """DPO's beta: how far the implicit reward beta s(y) may take the policy from the reference."""
    reference_free: bool = False
    """s(y) = log pi(y | x): no reference model (pi_ref uniform), no reference copy kept."""


@dataclass
class AlgoConfig:
    name: str = "grpo"
    """The conf/algo option this came from (used in run names and logs)."""
    objective: str = choice("policy_gradient", OBJECTIVES)
    """policy_gradient: the engines sample, rewards score, the policy loss below trains | sft: supervised
    fine-tuning on the data's responses (data.response_key, or a built-in task's worked examples), loss = mean NLL
    of the response tokens with EOS (``loss_agg``); the engines serve the evals only. The RL fields below are
    refused when set (config/rules.py) | opd: on-policy distillation from ``teacher`` (the policy loss below, the
    advantage of TeacherConfig) | dpo: DPO on the data's chosen / rejected pairs (``dpo``; refusals as sft's)."""
    advantage_estimator: str = choice("grpo", ADVANTAGE_ESTIMATORS)
    """grpo | reinforce_pp | reinforce_pp_baseline | gae (PPO with a critic)."""
    policy_loss: str = choice("ppo_clip", POLICY_LOSSES)
    """ppo_clip (token ratio) | gspo (sequence ratio) | cispo (clipped stop-gradient IS weight)."""
    std_normalization: bool = True
    """GRPO: divide the group-centred reward by the group std (Dr.GRPO turns it off)."""
    normalize_advantages: bool = False
    """Whiten advantages over the whole batch under the loss mask (REINFORCE++ always whitens)."""
    eps_clip: float = non_negative(0.2)
    """Lower PPO clip: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: Optional[float] = non_negative(None)
    """Upper PPO clip (DAPO clip-higher, e.g. 0.28); null means eps_clip."""
    eps_clip_c: Optional[float] = within(None, 1, low_open=True)
    """Dual-clip bound (> 1, e.g. 3.0) capping the loss of negative-advantage tokens; null disables."""
    kl_loss_coef: float = non_negative(0.0)
    """Weight of the KL(policy || reference) loss term; 0 disables. Exclusive with kl_coef."""
    kl_loss_type: str = choice("low_var_kl", KL_TYPES)
    """KL estimator: k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10])."""
    kl_coef: float = non_negative(0.0)
    """Weight of the per-token KL penalty subtracted from the reward (reward shaping); 0 disables."""
    entropy_coef: float = non_negative(0.0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    loss_agg: str = choice("token_mean", LOSS_AGGS)
    """token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (Dr.GRPO: / max tokens)."""
    gamma: float = within(1.0, 0, 1)
    """Discount per token for REINFORCE++ returns and GAE."""
    lam: float = within(1.0, 0, 1)
    """GAE lambda."""
    value_clip: float = non_negative(0.2)
    """PPO value-loss clip range around the old value."""
    value_loss_coef: float = non_negative(0.5)
    """Weight of the critic's value loss (PPO only)."""
    tis_cap: Optional[float] = within(None, 1)
    """Truncated importance sampling between trainer-old and rollout logprobs: clamp of the weight (e.g. 2.0); null off."""
    mis_cap: Optional[float] = within(None, 1, low_open=True)
    """Masked importance sampling: tokens whose trainer-old / rollout probability ratio lies outside
    [1 / mis_cap, mis_cap] leave the policy-gradient loss (e.g. 2.0); null off. For the train-vs-rollout mismatch
    that remains (train/train_rollout_*), next to or instead of tis_cap."""
    routing_replay: bool = False
    """MoE models: the trainer's forward passes (old, reference and training) route every token to the experts the
    engine chose for it (rollout routing replay), so rollout and training route alike; the engines report them
    (--enable-return-routed-experts). Off: the trainer's routers choose anew, and a near-tie that flips adds to
    the train-vs-rollout logprob gap."""
    true_on_policy: bool = False
    """The trainer's forward computes exactly what the engine computed for every response token: both run the
    batch-invariant forward (model/invariant.py: fixed-shape matmuls, attention in the decode's form, the engine's
    log-softmax), so train/train_rollout_logprob_abs_diff is 0.0 on a sync run, on CPU (fp32) and GPU (bf16). Dense
    models, an engine kind and a train backend whose records allow it (fsdp; megatron at one rank per replica), no
    LoRA, nothing compiled."""
    dynamic_filter: Optional[str] = None
    """Group filter for dynamic sampling: nonzero_std (DAPO) or a dotted path to fn(group) -> bool | (bool, reason)."""
    overlong_buffer_tokens: int = non_negative(0)
    """DAPO soft overlong punishment: the last N tokens before max_response_tokens are penalised linearly; 0 off."""
    overlong_penalty: float = non_negative(1.0)
    """Reward subtracted at the hard limit by the overlong punishment (linear from 0 over the buffer)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """algo.objective=opd: the teacher and how its scores enter the advantage."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """algo.objective=dpo: beta and the reference."""

    @property
    def needs_reference(self) -> bool:
        """A reference policy is kept only when a KL term or DPO's implicit reward uses it."""
        return self.kl_loss_coef > 0 or self.kl_coef > 0 or (self.objective == "dpo" and not self.dpo.reference_free)

    @property
    def from_data(self) -> bool:
        """sft and dpo train on the data's responses: nothing is sampled, the engines serve the evals only."""
        return self.objective in ("sft", "dpo")

    @property
    def pairs(self) -> bool:
        """dpo: each row is a chosen and a rejected response, two samples next to each other."""
        return self.objective == "dpo"

    @property
    def needs_critic(self) -> bool:
        """PPO's GAE estimator learns a value model next to the policy."""
        return self.advantage_estimator == "gae"

    @property
    def distills(self) -> bool:
        """On-policy distillation: the trainer ranks hold the teacher and score every sampled token with it."""
        return self.objective == "opd"

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.distills and self.teacher.path is None:
            yield Problem((f"{prefix}teacher.path", f"{prefix}objective"), "on-policy distillation (objective=opd) "
                          "scores the student's samples with a teacher, and none is given",
                          f"set {prefix}teacher.path=<HF checkpoint dir> or a conf/model option (e.g. tiny_teacher)")
        if self.objective != "dpo" and self.dpo != DpoConfig():
            yield Problem((f"{prefix}dpo", f"{prefix}objective"), f"algo.dpo is set but objective={self.objective} "
                          "does not train on preference pairs", f"set {prefix}objective=dpo (algo=dpo), or drop the "
                          f"{prefix}dpo overrides")
        if not self.distills and self.teacher != TeacherConfig():
            yield Problem((f"{prefix}teacher", f"{prefix}objective"), f"algo.teacher is set but objective="
                          f"{self.objective} has no teacher", f"set {prefix}objective=opd (algo=opd), or drop the "
                          f"{prefix}teacher overrides")
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            yield Problem((f"{prefix}kl_coef", f"{prefix}kl_loss_coef"),
                          f"KL as reward shaping (kl_coef={self.kl_coef}) and as a loss term "
                          f"(kl_loss_coef={self.kl_loss_coef}) are mutually exclusive", "set one of them to 0")
        if self.policy_loss == "gspo" and self.loss_agg != "seq_mean_token_mean":
            yield Problem((f"{prefix}policy_loss", f"{prefix}loss_agg"),
                          f"GSPO's sequence-level ratio is defined with seq_mean_token_mean, got loss_agg={self.loss_agg}",
                          f"set {prefix}loss_agg=seq_mean_token_mean")
        if self.dynamic_filter is not None and self.dynamic_filter != "nonzero_std" and "." not in self.dynamic_filter:
            yield Problem((f"{prefix}dynamic_filter",),
                          f"'{self.dynamic_filter}' is neither nonzero_std nor a dotted path",
                          f"set {prefix}dynamic_filter=nonzero_std or my_pkg.filters.fn")
