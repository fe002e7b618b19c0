"""train=megatron's gradients after the last micro-batch: reduction over TP, the tied embedding and DP x CP, then
the global grad norm and clipping.

Reduction: megatron's DistributedDataParallel needs CUDA and megatron's own training loop state; this backend
reduces gradients itself, identically on CPU (gloo) and GPU (nccl): after the last micro-batch, the q/k-norm
gradients (shared across heads, each TP rank sees only its heads; not multi-latent attention's latent norms, whose
gradients are whole on every rank) are summed over TP, a tied embedding's two copies
(first stage's embedding, last stage's output layer, when pp > 1) are summed over megatron's embedding group, then
every gradient is summed over CP and averaged over DP in flat buckets (one all-reduce over megatron's
data-parallel-with-CP group, divided by dp). Under expert parallelism (ep > 1) an expert's gradient already covers
the tokens of its whole EP group (the dispatcher gathered them, and its backward scattered their gradients back), so
experts are summed over the expert-data-parallel group only (the stage's DP and CP ranks holding the same experts:
one per EP group, together every token of the stage's dp x cp ranks), then divided by dp as well:

    g_e = (1 / dp) sum_{EP groups G} sum_{ranks r in G} d loss_r / d W_e  =  the dense rule's sum over DP x CP / dp

the router and every other parameter go the usual way. Each pipeline stage reduces its own parameters (megatron
forms every DP, EP and expert-DP group inside one stage).

Grad norm: sum of squares of the TP-split parameters all-reduced over TP, plus the replicated ones (norms) once,
summed over the PP stages (the tied embedding's copy counted once; CP peers hold the same reduced gradients and
each counts them once, without a CP reduction); at ep > 1 each EP rank's own experts' squares are summed over the EP
group first (then over TP with the other split parameters). Clipping with it is optim.clip_and_step's.
"""

import torch
import torch.distributed as dist

from slime_hydra.train.megatron.convert import TIED_COPY

BUCKET_ELEMENTS = 64 * 1024 * 1024
"""Gradient elements per DP all-reduce (256 MiB of fp32)."""


def _latent_norms(model: torch.nn.Module) -> set[int]:
    """ids of multi-latent attention's latent-norm weights: they norm a latent every TP rank holds whole, and the
    column-parallel projection after them all-reduces its input gradient, so their gradients are complete on every
    rank (unlike q/k norms over this rank's heads)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return {id(p) for m in model.modules() if isinstance(m, MultiLatentAttention)
            for norm in (getattr(m, "q_layernorm", None), m.kv_layernorm) if norm is not None
            for p in norm.parameters()}


class Gradients:
    """Reduction and clipping of one rank's parameter gradients (module docstring). ``params``: this stage's
    parameters by megatron name, of which only those with requires_grad count (train.lora freezes the base);
    ``tp_split``: the names of those split over TP; ``tied_copy``: this last stage
    holds a copy of the first stage's embedding; ``shared``: the tied embedding's copy on this stage whose gradient
    is summed over the embedding group (None: no tied embedding across stages here); ``experts``: the names of this
    rank's expert parameters when ep > 1 (reduced over ``expert_dp_group``, norms summed over ``ep_group``)."""

    def __init__(self, model: torch.nn.Module, params: dict[str, torch.nn.Parameter], tp_split: set[str],
                 tied_copy: bool, shared: torch.nn.Parameter | None, tp_group: dist.ProcessGroup,
                 pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup, dp_cp_group: dist.ProcessGroup,
                 device: torch.device, experts: set[str] = frozenset(), ep_group: dist.ProcessGroup | None = None,
                 expert_dp_group: dist.ProcessGroup | None = None):
        self.model, self.device = model, device
        self.params = {name: p for name, p in params.items() if p.requires_grad}
        self._experts, self.ep_group, self.expert_dp_group = set(experts), ep_group, expert_dp_group
        self._tp_split, self._tied_copy = tp_split, tied_copy
        self._shared = shared if shared is not None and shared.requires_grad else None  # frozen under LoRA
        self._tp_partial = [n for n, p in self.params.items() if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))
                            and id(p) not in _latent_norms(model)]
        self.tp_group, self.pp_group, self.dp_cp_group = tp_group, pp_group, dp_cp_group
        self.tp_size, self.pp_size = dist.get_world_size(tp_group), dist.get_world_size(pp_group)
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_cp_size = dist.get_world_size(dp_cp_group)

    def reduce(self) -> None:
        """Every gradient summed or averaged over the groups that share it (module docstring). Collective."""
        from megatron.core import parallel_state

        params = list(self.params.values())
        for p in params:
            if p.grad is None:  # every rank must bring every gradient to the collectives
                p.grad = torch.zeros_like(p)
        if self.tp_size > 1:
            for name in self._tp_partial:
                dist.all_reduce(self.params[name].grad, group=self.tp_group)
        if self._shared is not None:  # d loss / d embedding = the input side's part + the output side's part
            dist.all_reduce(self._shared.grad, group=parallel_state.get_embedding_group())
        experts = [p for name, p in self.params.items() if name in self._experts]
        shared = [p for name, p in self.params.items() if name not in self._experts]
        # summed over CP (each rank's share of the tokens), averaged over DP; an expert's gradient already holds the
        # tokens of its EP group (gathered by the dispatcher): summed over the expert-data-parallel peers, / dp
        self._all_reduce_mean(shared, self.dp_cp_group)
        self._all_reduce_mean(experts, self.expert_dp_group)

    def _all_reduce_mean(self, params: list[torch.nn.Parameter], group) -> None:
        """Gradients summed over ``group`` in flat buckets, then divided by the data-parallel size."""
        if not params or group is None or (dist.get_world_size(group) == 1 and self.dp_size == 1):
            return
        bucket, elements = [], 0
        for k, p in enumerate(params):
            bucket.append(p.grad)
            elements += p.grad.numel()
            if elements >= BUCKET_ELEMENTS or k == len(params) - 1:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(flat, group=group)
                flat /= self.dp_size
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(part.view_as(g))
                bucket, elements = [], 0

    def norm(self) -> torch.Tensor:
        """Global grad norm (module docstring; a 0-dim fp64 device tensor, no sync). Per-tensor norms in one
        multi-tensor kernel (fp32, as clip_grad_norm_), their squares summed in fp64: a few launches instead of
        four per parameter."""
        grads: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # TP-split or not
        expert_grads: list[torch.Tensor] = []  # ep > 1: this EP rank's own experts (TP-split)
        for name, p in self.params.items():
            if self._tied_copy and name == TIED_COPY.megatron:
                continue  # counted on the first stage, as the embedding
            if name in self._experts:
                expert_grads.append(p.grad.detach())
            else:
                grads[name in self._tp_split].append(p.grad.detach())

        def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
            if not tensors:
                return torch.zeros((), dtype=torch.float64, device=self.device)
            return torch.stack(torch._foreach_norm(tensors)).double().pow(2).sum()

        split, replicated = squares(grads[True]), squares(grads[False])
        if expert_grads:
            own = squares(expert_grads)
            dist.all_reduce(own, group=self.ep_group)
            split = split + own
        if self.tp_size > 1:
            dist.all_reduce(split, group=self.tp_group)
        total = split + replicated
        if self.pp_size > 1:
            dist.all_reduce(total, group=self.pp_group)
        return total.sqrt()
