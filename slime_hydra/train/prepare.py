"""From scored samples to a train batch with advantages: the 'old/ref logprobs -> advantages' part of a step.

    batch = to_train_batch(samples, pad_id, reward_key)        # rewards [B], rollout logprobs [B, T]
    metrics = add_advantages(batch, algo, group_size, old, ref, values, teacher=teacher)  # advantages, returns [B, T]
    metrics = held_out_losses(trainer, {name: samples}, pad_id)    # algo=sft's eval/<name>/sft_loss
    metrics = dpo_weights(batch, beta, policy, ref)                 # algo=dpo (add_advantages calls it)

Samples arrive group-contiguous (the group_size samples of one prompt next to each other), as the buffer hands
them out; GRPO-style baselines rely on that order.
"""

from typing import Optional, Sequence

import torch

from slime_hydra import routed_experts
from slime_hydra.algo import compute_advantages, compute_kl, overlong_penalty
from slime_hydra.algo.config import AlgoConfig
from slime_hydra.buffer.sample import Sample
from slime_hydra.train.batch import TrainBatch, collate


def to_train_batch(samples: Sequence[Sample], pad_id: int, reward_key: Optional[str] = None,
                   routing: Optional[tuple[int, int]] = None) -> TrainBatch:
    """Pad samples into a TrainBatch; extras: rewards [B] and rollout_logprobs [B, T] when the engine gave them.
    routing: (num_layers, top_k) with algo.routing_replay: every sample's routed experts go into
    ``batch.routed_experts`` (a sample without them is an error: the engine was not asked for them)."""
    if any(s.response_length == 0 for s in samples):
        raise ValueError("samples with an empty response cannot be trained on (drop or mark them failed first)")
    extras: dict[str, list] = {"rewards": [s.scalar_reward(reward_key) for s in samples]}
    if all(len(s.rollout_log_probs) == s.response_length for s in samples):
        extras["rollout_logprobs"] = [s.rollout_log_probs for s in samples]
    experts = None
    if routing is not None:
        missing = [s.index for s in samples if not s.routed_experts]
        if missing:
            raise ValueError(f"algo.routing_replay: samples {missing[:8]} came without routed experts (the engines "
                             "must run with --enable-return-routed-experts and report them in every answer)")
        experts = [routed_experts.decode(s.routed_experts, *routing) for s in samples]
    return collate([s.tokens for s in samples], [s.response_length for s in samples],
                   [s.loss_mask for s in samples], pad_id=pad_id, extras=extras, routed_experts=experts)


def add_advantages(batch: TrainBatch, algo: AlgoConfig, group_size: int, old_logprobs: Optional[torch.Tensor],
                   ref_logprobs: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
                   max_response_tokens: Optional[int] = None,
                   teacher: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Store old_logprobs, ref_logprobs, advantages and returns (and values as old_values) in batch.extras; return
    the step's metrics of this part: ``train/advantage_abs_mean`` (mean |advantage| over the trained tokens),
    ``train/overlong_penalty`` (DAPO: its mean over the samples) and ``train/reward_kl`` (reward shaping: the
    shaping KL's mean over the trained tokens, the KL term this objective optimizes; its loss-term counterpart is the
    actor loss's ``train/kl_loss``).

    The KL of reward shaping (algo.kl_coef > 0) is k-estimator(old || ref) per token, computed here once.
    old_logprobs may be None when the loss takes them from its own forward (``needs_old_logprobs`` is False).
    With algo.overlong_buffer_tokens > 0 (DAPO) the rewards get ``overlong_penalty`` of the response lengths
    against ``max_response_tokens`` first (the penalty is kept as extras["overlong_penalty"]).

    On-policy distillation (``teacher``: the teacher's [B, T] logprobs of the sampled tokens): the advantage becomes
    ``algo.teacher.reward_weight * A - algo.teacher.kl_coef * (student - teacher)`` per token (algo/config.py,
    TeacherConfig), the student's logprobs being old_logprobs when given, else the engine's (rollout_logprobs);
    metrics ``train/opd_reverse_kl`` (the mean of student - teacher over the trained tokens: a one-sample estimate
    of KL(student || teacher) per token, in nats) and ``train/teacher_logprob`` (the teacher's mean logprob there).
    algo=sft: nothing (the data's tokens are the target); algo=dpo: ``dpo_weights`` of the old (current) logprobs.
    """
    if algo.objective == "sft":
        return {}
    if algo.pairs:
        return dpo_weights(batch, algo.dpo.beta, old_logprobs, ref_logprobs)
    extras = batch.extras
    if algo.overlong_buffer_tokens > 0:
        if max_response_tokens is None:
            raise ValueError("algo.overlong_buffer_tokens > 0 needs max_response_tokens (rollout.max_response_tokens)")
        extras["overlong_penalty"] = overlong_penalty(
            batch.response_lengths, max_response_tokens=max_response_tokens,
            buffer_tokens=algo.overlong_buffer_tokens, penalty=algo.overlong_penalty).to(extras["rewards"].dtype)
        extras["rewards"] = extras["rewards"] + extras["overlong_penalty"]
    if old_logprobs is not None:
        extras["old_logprobs"] = old_logprobs
    if ref_logprobs is not None:
        extras["ref_logprobs"] = ref_logprobs
    kl = None
    if algo.kl_coef > 0:
        if ref_logprobs is None or old_logprobs is None:
            raise ValueError("algo.kl_coef > 0 shapes the reward with KL to the reference: old and ref logprobs needed")
        kl = compute_kl(old_logprobs, ref_logprobs, batch.loss_mask, kl_loss_type=algo.kl_loss_type)
    advantages, returns = compute_advantages(
        algo.advantage_estimator, rewards=extras["rewards"], loss_mask=batch.loss_mask,
        group_size=group_size if algo.advantage_estimator in ("grpo", "reinforce_pp_baseline") else None,
        std_normalization=algo.std_normalization, gamma=algo.gamma, lam=algo.lam, kl_coef=algo.kl_coef, kl=kl,
        values=values, normalize_advantages=algo.normalize_advantages)
    tokens = batch.loss_mask.sum()
    metrics = {}
    if teacher is not None:
        student = old_logprobs if old_logprobs is not None else extras.get("rollout_logprobs")
        if student is None:
            raise ValueError("on-policy distillation needs the student's logprobs of its samples: the engines report "
                             "none (return_logprob) and no old-logprob pass ran")
        reverse_kl = (student - teacher) * batch.loss_mask
        advantages = algo.teacher.reward_weight * advantages - algo.teacher.kl_coef * reverse_kl
        extras["teacher_logprobs"] = teacher
        metrics["train/opd_reverse_kl"] = float(reverse_kl.sum() / tokens)
        metrics["train/teacher_logprob"] = float((teacher * batch.loss_mask).sum() / tokens)
    extras["advantages"], extras["returns"] = advantages, returns
    if values is not None:
        extras["old_values"] = values
    metrics["train/advantage_abs_mean"] = float((advantages.abs() * batch.loss_mask).sum() / tokens)
    if "overlong_penalty" in extras:
        metrics["train/overlong_penalty"] = float(extras["overlong_penalty"].mean())
    if kl is not None:
        metrics["train/reward_kl"] = float((kl * batch.loss_mask).sum() / tokens)
    return metrics


def dpo_weights(batch: TrainBatch, beta: float, policy: torch.Tensor, ref: Optional[torch.Tensor]) -> dict[str, float]:
    """algo=dpo: the per-row weights whose policy-gradient step is DPO's step, and DPO's metrics.

    Rows come in pairs (2i: chosen, reward 1; 2i+1: rejected, reward 0; rollout/sft.py). With s = sum over the
    response of (policy - ref) logprobs (ref None: reference-free, 0) and z = beta (s_chosen - s_rejected), the
    loss of a pair is -log sigmoid(z), whose gradient is -beta sigmoid(-z) (grad log pi(chosen) - grad log
    pi(rejected)). So each row gets the constant w = +-beta sigmoid(-z) on its response tokens
    (extras["advantages"]) and ``train/objectives.DpoLoss`` minimises -w log pi(y) summed over the row: at the
    parameters ``policy`` was computed with (one optimizer step per batch, no dropout) its gradient is DPO's,
    exactly, whatever rows the data-parallel ranks and micro-batches split the pairs into. Metrics (TRL's):
    train/dpo_loss, train/dpo_accuracy (the share of pairs with z > 0), train/dpo_margin (mean z),
    train/dpo_chosen_reward and train/dpo_rejected_reward (mean beta s)."""
    rewards, mask = batch.extras["rewards"], batch.loss_mask
    if batch.size % 2 or not (torch.all(rewards[0::2] == 1) and torch.all(rewards[1::2] == 0)):
        raise ValueError("algo=dpo needs the batch as pairs: chosen (reward 1) then rejected (reward 0)")
    s = (policy * mask).sum(-1) - ((ref * mask).sum(-1) if ref is not None else 0.0)
    chosen, rejected = beta * s[0::2], beta * s[1::2]
    z = chosen - rejected
    w = beta * torch.sigmoid(-z)
    batch.extras["advantages"] = torch.stack([w, -w], 1).reshape(-1, 1) * mask
    return {"train/dpo_loss": float(-torch.nn.functional.logsigmoid(z).mean()),
            "train/dpo_accuracy": float((z > 0).float().mean()), "train/dpo_margin": float(z.mean()),
            "train/dpo_chosen_reward": float(chosen.mean()), "train/dpo_rejected_reward": float(rejected.mean())}


def needs_old_logprobs(algo: AlgoConfig, optimizer_steps_per_rollout: int) -> bool:
    """Whether old logprobs need their own forward pass before training.

    With one optimizer step per rollout batch, every micro-batch is trained by the policy that generated the
    advantages' batch, so old logprobs equal the training forward's (detached) and the extra pass is skipped
    (ratio = 1 exactly, ppo_kl = 0). KL reward shaping (kl_coef) needs them before the advantages. algo=sft's loss
    reads none; algo=dpo's weights are made of them (the current policy's).
    """
    return algo.pairs or (not algo.from_data and (optimizer_steps_per_rollout > 1 or algo.kl_coef > 0))


def held_out_losses(trainer, held_out: dict[str, list[dict]], pad_id: int) -> dict[str, float]:
    """algo=sft: ``eval/<name>/sft_loss`` of each eval set, the mean negative log-likelihood (nats per token) of its
    responses and EOS under the current policy, at temperature 1 (``trainer``: the TrainGroup; ``held_out``: each
    set's samples as dicts, RolloutManager.held_out)."""
    out = {}
    for name, samples in held_out.items():
        batch = to_train_batch([Sample.from_dict(s) for s in samples], pad_id)
        logp = trainer.logprobs(batch, "current", 1.0)[0]
        out[f"eval/{name}/sft_loss"] = float(-(logp * batch.loss_mask).sum() / batch.loss_mask.sum())
    return out
