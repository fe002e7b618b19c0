"""Token logprobs and entropy from logits whose vocabulary is split across the TP ranks, without gathering them.

Rank r holds logits z[:, v] for v in [start, start + V/t). With s = z - max (the max all-reduced over TP):

    log Z   = log sum_v exp(s_v)                     (sum-exp all-reduced)
    logp    = s_target - log Z                       (s_target: only the owning rank contributes, all-reduced)
    entropy = log Z - sum_v p_v s_v                  (sum_v exp(s_v) s_v all-reduced), p = exp(s - log Z)

Backward, per rank on its own slice: d logp / d s_v = 1[v = target] - p_v;  d entropy / d s_v = -p_v (s_v - E_p[s]).
Every TP rank ends with the same logp and entropy, so the loss (and its gradient) is the same on all of them.
"""

import torch
import torch.distributed as dist


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, with_entropy):
        tp = dist.get_world_size(group) if group is not None else 1
        local_vocab = logits.shape[-1]
        top = logits.detach().max(dim=-1).values
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - top.unsqueeze(-1)
        exp = shifted.exp()
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        pieces = [exp.sum(-1), shifted.gather(-1, index).squeeze(-1) * owned]
        if with_entropy:
            pieces.append((exp * shifted).sum(-1))
        pieces = torch.stack(pieces)
        if tp > 1:
            dist.all_reduce(pieces, group=group)
        log_z = pieces[0].log()
        logp = pieces[1] - log_z
        ctx.with_entropy = with_entropy
        if with_entropy:
            mean_s = pieces[2] / pieces[0]
            ctx.save_for_backward(shifted, log_z, index, owned, mean_s)
            return logp, log_z - mean_s
        ctx.save_for_backward(shifted, log_z, index, owned)
        return logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        shifted, log_z, index, owned, *rest = ctx.saved_tensors
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        grad = probs * -grad_logp.unsqueeze(-1)
        grad.scatter_add_(-1, index, (grad_logp * owned).unsqueeze(-1))
        if ctx.with_entropy and grad_entropy is not None:
            grad -= probs * (shifted - rest[0].unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group=None,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp [...] of targets [...] (global token ids) and the entropy [...] (or None), from this rank's fp32 logits
    [..., V/t] covering ids [vocab_start, vocab_start + V/t). Collective over ``group`` (the TP group)."""
    shape = targets.shape
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if with_entropy:
        logp, entropy = _VocabParallelLogProbs.apply(flat, flat_targets, vocab_start, group, True)
        return logp.view(shape), entropy.view(shape)
    return _VocabParallelLogProbs.apply(flat, flat_targets, vocab_start, group, False).view(shape), None
