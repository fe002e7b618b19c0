"""The loss callables the backends run: the algo config applied to a micro-batch's tensors.

A backend calls ``loss_fn(logp_or_values, entropy, micro_batch) -> (mean loss over the micro-batch's units,
metrics)``. These objects are small, picklable and built once per run from the algo config; they read the
micro-batch's extras (response-aligned [B, T]):

    ActorLoss:  advantages, old_logprobs; ref_logprobs when a KL term is on; rollout_logprobs when TIS / MIS is on, and
                whenever the engine returned them, for the train-vs-rollout mismatch metrics (rollout_mismatch).
                Without old_logprobs (one optimizer step per rollout: the policy that is trained is the one whose
                logprobs would be recomputed) the forward's own detached logprobs are used, which equal them.
    CriticLoss: old_values, returns
    SftLoss:    nothing (algo.objective=sft: the mean NLL of the response tokens under the loss mask, ``loss_agg``)
    DpoLoss:    advantages (algo.objective=dpo: train/prepare.dpo_weights' per-row constants)

``actor_loss(algo, max_response_tokens)`` is the policy's loss of the run's objective.
"""

from dataclasses import dataclass

import torch

from slime_hydra.algo import compute_policy_loss, rollout_mismatch, sft_loss, value_loss
from slime_hydra.algo.config import AlgoConfig
from slime_hydra.train.batch import TrainBatch


@dataclass(frozen=True)
class ActorLoss:
    algo: AlgoConfig
    max_response_tokens: int
    """rollout.max_response_tokens: the constant of the seq_mean_token_sum_norm aggregation."""

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, mb: TrainBatch):
        a, extras = self.algo, mb.extras
        loss, metrics = compute_policy_loss(
            logp, extras["old_logprobs"] if "old_logprobs" in extras else logp.detach(), extras["advantages"], mb.loss_mask, policy_loss=a.policy_loss,
            ref_logp=extras.get("ref_logprobs"), rollout_logp=extras.get("rollout_logprobs"), entropy=entropy,
            eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c,
            kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef,
            tis_cap=a.tis_cap, mis_cap=a.mis_cap, loss_agg=a.loss_agg, max_response_tokens=self.max_response_tokens)
        if "rollout_logprobs" in extras:
            metrics.update(rollout_mismatch(logp, extras["rollout_logprobs"], mb.loss_mask, loss_agg=a.loss_agg))
        return loss, metrics


@dataclass(frozen=True)
class CriticLoss:
    algo: AlgoConfig
    max_response_tokens: int

    def __call__(self, values: torch.Tensor, _entropy, mb: TrainBatch):
        loss, metrics = value_loss(values, mb.extras["old_values"], mb.extras["returns"], mb.loss_mask,
                                   value_clip=self.algo.value_clip, loss_agg=self.algo.loss_agg,
                                   max_response_tokens=self.max_response_tokens)
        return loss * self.algo.value_loss_coef, metrics


@dataclass(frozen=True)
class SftLoss:
    algo: AlgoConfig
    max_response_tokens: int

    def __call__(self, logp: torch.Tensor, _entropy, mb: TrainBatch):
        return sft_loss(logp, mb.loss_mask, loss_agg=self.algo.loss_agg, max_response_tokens=self.max_response_tokens)


@dataclass(frozen=True)
class DpoLoss:
    """algo=dpo: -w log pi(y) summed over each row's response, w = +-beta sigmoid(-z) of its pair
    (train/prepare.dpo_weights): its gradient at the batch's parameters is DPO's. Returned per row, x 2, so that
    loss_agg=seq_mean_token_sum (a mean over the batch's rows) makes the mean over pairs; train/dpo_loss itself
    is the prepare step's."""
    algo: AlgoConfig
    max_response_tokens: int

    def __call__(self, logp: torch.Tensor, _entropy, mb: TrainBatch):
        per_row = -(mb.extras["advantages"] * logp * mb.loss_mask).sum(-1)
        return 2 * per_row.mean(), {}


def actor_loss(algo: AlgoConfig, max_response_tokens: int) -> ActorLoss | SftLoss | DpoLoss:
    """The policy's loss for algo.objective: policy_gradient and opd -> ActorLoss, sft -> SftLoss, dpo -> DpoLoss."""
    return {"sft": SftLoss, "dpo": DpoLoss}.get(algo.objective, ActorLoss)(algo, max_response_tokens)
