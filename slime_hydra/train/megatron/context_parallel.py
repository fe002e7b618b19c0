"""Context parallelism (CP) without TransformerEngine: megatron's load-balanced sequence split, and the gathers that
let attention and the loss see the whole sequence.

Layout (megatron's, the one its RoPE slicing ``get_pos_emb_on_this_cp_rank`` assumes): a sequence padded to S, a
multiple of 2 * cp, is cut into 2 * cp chunks of c = S / (2 * cp) tokens; CP rank r holds chunks r and
2 * cp - 1 - r, in that order. Under causal attention chunk k attends to (k + 1) * c keys, so every rank's two
chunks together cost (2 * cp + 1) * c^2 score entries: the work is balanced.

Attention is the "all-gather KV" form of CP (the Llama 3 paper's): each layer all-gathers K and V over the CP group
and attends from the local queries to the keys of the whole sequence. It is not ring attention: K and V of all S
tokens are materialised on every rank (O(S) memory per rank per layer; activations other than K/V stay O(S / cp)),
and the gather is not overlapped with compute. Its backward reduce-scatters the K/V gradients to their owners.

Gradients: a rank's parameter gradients cover its own tokens' computation (including other ranks' queries
attending to its keys, delivered by the K/V reduce-scatter); summing them over the CP group gives the full
gradient. The per-token outputs (logprobs, entropy, values) are gathered in full sequence order on every CP rank,
which then computes the same loss; the backward of that gather keeps this rank's chunks only (no sum: the CP peers
hold identical copies of the downstream computation).
"""

import torch
import torch.distributed as dist


def padded_length(length: int, cp: int) -> int:
    """The smallest multiple of 2 * cp that holds ``length`` tokens."""
    return -(-length // (2 * cp)) * 2 * cp


def _chunk_order(cp: int) -> list[int]:
    """Global chunk indices in rank-major order (rank 0's two chunks, then rank 1's ...)."""
    return [k for r in range(cp) for k in (r, 2 * cp - 1 - r)]


def split_sequence(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """Rank ``rank``'s chunks of ``x`` along ``dim`` (whose size is a multiple of 2 * cp)."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def local_positions(length: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """[length / cp] global positions of the tokens rank ``rank`` holds in a sequence of ``length`` tokens."""
    return split_sequence(torch.arange(length, device=device), 0, rank, cp)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 into global sequence order; backward: reduce-scatter (``reduce=True``: the gathered
    tensor feeds different computation on each rank) or this rank's slice (``reduce=False``: every rank computes the
    same thing from it)."""

    @staticmethod
    def forward(ctx, x, group, reduce):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.reduce, ctx.rank, ctx.cp = group, reduce, rank, cp
        x = x.contiguous()
        gathered = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x, group=group)
        chunks = gathered.view(2 * cp, -1, *x.shape[1:])
        inverse = torch.empty(2 * cp, dtype=torch.long)
        inverse[_chunk_order(cp)] = torch.arange(2 * cp)
        return chunks[inverse.to(x.device)].reshape(gathered.shape)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        order = torch.tensor(_chunk_order(cp), device=grad.device)
        rank_major = grad.contiguous().view(2 * cp, -1, *grad.shape[1:])[order].reshape(grad.shape)
        if not ctx.reduce:
            return rank_major.chunk(cp)[ctx.rank].clone(), None, None
        out = grad.new_empty((grad.shape[0] // cp, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, rank_major, group=ctx.group)
        return out, None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 0, reduce_grad: bool = True) -> torch.Tensor:
    """The full sequence, in global order, from every CP rank's chunks of ``x`` along ``dim``; differentiable
    (see _GatherSequence for ``reduce_grad``). Collective over ``group``."""
    return _GatherSequence.apply(x.movedim(dim, 0), group, reduce_grad).movedim(0, dim)
