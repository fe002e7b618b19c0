"""megatron-core's MoE layer (router, token permutation, experts) inside this backend's parallelism, on CPU and GPU.

The layer is megatron's ``MoELayer`` with its ``TopKRouter`` and experts (``SequentialMLP``; TEGroupedMLP with
TransformerEngine). ``Router`` only computes the gating logits where the weight lives (megatron's gating moves a
host weight to CUDA, and its gating function needs TransformerEngine). Two things around the layer are this
backend's:

- *Token movement* (``TokenGather``: megatron's allgather dispatcher with its own collectives). Megatron's
  dispatchers assume sequence parallelism (each TP rank holds s / tp tokens) and allocate their gather buffers with
  ``torch.cuda.current_device()``. Here hidden states are replicated over TP (no sequence parallelism, as in the
  dense layers), so the experts are TP-split like a dense MLP: each TP rank runs its F / tp slice of every expert
  on all tokens (fc1 column-parallel, fc2 row-parallel). The tokens and routing probabilities enter through an
  identity whose backward all-reduces their partial gradients over TP, and the experts' partial outputs are summed
  over TP: megatron's copy-to / reduce-from-TP regions, written here because megatron's all-reduce drops its result
  for a non-contiguous gradient, which the probabilities' is. Over EP, every rank all-gathers the tokens,
  probabilities and routing map of its EP group, runs its local experts on the tokens routed to them, and
  reduce-scatters the outputs back to the tokens' owners (backward: the reverse collectives). The router runs on
  every TP rank on the same tokens, so its gradient is complete there (no TP reduction).
- *Routing replay* (``ReplayedChoice``): with the engine's routed experts in the batch, each router's top-k takes
  them (backend.py sets each router's target per micro-batch).
- *Equal shapes over EP* (``MoE.forward``). EP peers are different data-parallel ranks, whose micro-batches differ
  in shape; the tokens are flattened to [n, 1, H] and zero-padded to the EP group's largest n (one all-reduce of a
  scalar per MoE layer call). A zero token's expert outputs are zero and are cut off, so padding changes nothing
  but the load-balancing loss (when on) and the work. EP peers must also run the same number of micro-batches
  (backend.py adds empty ones).

megatron's MoELayer.forward refuses to train with TP > 1 without sequence parallelism (its dispatchers would count
each token tp times); ``MoE.forward`` calls the same steps (route, dispatch, experts, combine) with the collectives
above, for which replicated tokens are exact.

In the backend (backend.py): expert parallelism (train.ep > 1) splits each layer's experts over ep ranks of a pipeline
stage that are DP or CP peers (EP rank k holds experts [k E / ep, (k + 1) E / ep); megatron's expert grid "tp-ep-dp-pp"
folds the stage's cp x dp ranks into EP x expert-DP, so ep divides cp x dp); the dispatcher all-gathers the EP group's
tokens (CP peers' are other chunks of the same sequences), and EP peers run the same number of micro-batches
(``_micro_batches`` adds empty ones to the ranks with fewer), which with pp > 1 puts each MoE layer's collectives at the
same place of every peer's 1F1B order (it depends only on the stage and the count). Expert gradients are reduced over
the expert-data-parallel group, the grad norm sums each EP rank's experts once, the ZeRO optimizer shards the experts'
state over the expert-data-parallel peers and the rest over DP x CP, checkpoints hold one file per (PP stage, TP rank,
EP rank) and the dense optimizer state in one per (PP stage, TP rank), and weight export gathers every expert of every
stage on every rank. Built and tested with TP, DP, PP and CP (train/config.megatron_moe_problems refuses an ep not
dividing E and cp x dp). The router's load-balancing loss (megatron's switch loss per MoE layer and micro-batch) is off
unless ``train.megatron.moe_aux_loss_coeff`` > 0; each micro-batch's is weighted like its main loss (units(micro) /
units(global) * dp, through megatron's MoEAuxLossAutoScaler, whose scale each MoE layer's backward reads: every stage
sets it right before each micro-batch's backward, which with pp > 1 follows later forwards); train=fsdp trains without
one, so the two are compared with it off.
"""

import copy

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from slime_hydra.routed_experts import NO_EXPERT


class _IntoTP(torch.autograd.Function):
    """Identity; backward: the gradient summed over ``group`` (megatron's copy-to-TP region, whose backward
    all-reduces a contiguous copy of a non-contiguous gradient and returns the gradient unreduced: the routing
    probabilities' gradient arrives transposed)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Sum over ``group``; backward: identity (megatron's reduce-from-TP region, on a contiguous copy)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter along dim 0 over ``group`` (sum, rank order); backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad, group=ctx.group)
        return out, None


class TokenGather(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher (local routing map, permutation, unpermutation) with the collectives of the
    module docstring: tokens replicated over (expert) TP, gathered and scattered over EP."""

    def token_dispatch(self, hidden_states, probs):
        if self.tp_size > 1:
            hidden_states = _IntoTP.apply(hidden_states, self.tp_group)
            probs = _IntoTP.apply(probs, self.tp_group)
        if self.ep_size > 1:
            with torch.no_grad():  # as bytes: compiled (train.compile), a gathered bool tensor came back as bytes,
                # which megatron's permutation (masked_select) refuses
                self.routing_map = _GatherTokens.apply(self.routing_map.to(torch.uint8), self.ep_group).bool()
            probs = _GatherTokens.apply(probs, self.ep_group)
            hidden_states = _GatherTokens.apply(hidden_states, self.ep_group)
        return hidden_states, probs

    def token_combine(self, hidden_states):
        dtype = hidden_states.dtype  # sums in the probabilities' dtype, as megatron's combine
        hidden_states = hidden_states.to(self.local_probs.dtype)
        if self.ep_size > 1:
            hidden_states = _ScatterTokens.apply(hidden_states, self.ep_group)
        if self.tp_size > 1:
            hidden_states = _SumOverTP.apply(hidden_states, self.tp_group)
        return hidden_states.to(dtype)


class ReplayedChoice:
    """A router's choice of experts replaced by the engine's where it reported one (``algo.routing_replay``).

    megatron's top-k routing (``topk_routing_with_score_function``) asks its ``router_replay`` for the top-k of the
    routing scores; this one takes megatron's own top-k, then puts ``target``'s experts in the rows that have them
    (-1 rows, and rows past the target's end such as the EP padding, keep their own) and gathers the scores there.
    The weights are then megatron's function of the scores at the chosen experts, as for its own choice (softmax
    over the chosen logits, or the softmax / sigmoid scores renormalised and scaled). The load-balancing loss, when
    on, still counts the router's own top-k. megatron's ``RouterReplay`` registers every instance in a process-wide
    list and replaces whole choices; this keeps the target per router and merges it row by row."""

    def __init__(self):
        self.target: torch.Tensor | None = None
        """[tokens, top_k] int64 experts of this layer for the forward's tokens ([s, b] order), or None."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, indices
        target = self.target
        if target.shape[0] < scores.shape[0]:
            target = torch.nn.functional.pad(target, (0, 0, 0, scores.shape[0] - target.shape[0]), value=NO_EXPERT)
        indices = torch.where((target != NO_EXPERT).all(dim=-1, keepdim=True), target, indices)
        return scores.gather(1, indices), indices


class Router(TopKRouter):
    """megatron's TopKRouter (softmax or sigmoid scores, top-k, its load-balancing loss) with its own gating:
    megatron's moves a host weight to CUDA on every call, and its gating function (``router_gating_linear``) reads a
    TransformerEngine GEMM that is undefined when TE is not installed (a NameError in 0.16.1). Same logits:
    input @ weight^T in the router dtype (``moe_router_dtype``, else the input's).

    The load-balancing and z losses count tokens over the ranks that hold different ones: megatron's TP x CP (x DP)
    groups assume sequence parallelism; here TP ranks hold the same tokens, so the groups are CP (and DP x CP).

    With ``moe_router_enable_expert_bias`` (the grouped router's score correction) megatron allocates ``expert_bias``
    and its token counter with ``torch.cuda.current_device()``; here they are the same buffers made beside the
    weight (``to(device)`` moves them with the model). The bias stays as loaded: megatron updates it only in its own
    training loop's gradient finalisation, which this backend does not run (and its update rate is 0)."""

    def __init__(self, config, pg_collection=None):
        expert_bias = config.moe_router_enable_expert_bias
        if expert_bias:  # megatron's own copy idiom (SharedExpertMLP): the buffers are made below instead
            config, original = copy.copy(config), config
            config.moe_router_enable_expert_bias = False
        super().__init__(config=config, pg_collection=pg_collection)
        if expert_bias:
            self.config, self.enable_expert_bias = original, True
            experts = original.num_moe_experts
            del self.local_tokens_per_expert, self.expert_bias  # megatron's None placeholders
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(experts))
        self.tp_cp_group = pg_collection.cp
        self.tp_dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.router_replay = ReplayedChoice()

    def gating(self, input):
        if self.weight.is_cuda and getattr(moe_utils, "te_general_gemm", None) is not None:
            return super().gating(input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm's backward refuses an expanded one)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class GroupedExperts(SequentialMLP):
    """megatron's SequentialMLP (its parameters, names and TP / EP layout unchanged: local expert e's
    ``linear_fc1`` [2F / tp, H] and ``linear_fc2`` [H, F / tp]) computed as two grouped matmuls over all local
    experts (torch's ``grouped_mm``, CPU and CUDA) instead of a Python loop of 2 x E small ones:

        h = x_e W1_e^T,  a = silu(h_gate) * h_up * p,  y = a W2_e^T     for the rows x_e routed to expert e

    with p the routing probability, applied after the activation in fp32 and cast back, as megatron's MLP does. The
    expert weights are stacked on every call ([E, H, 2F / tp], [E, F / tp, H]: one copy of the local experts'
    weights forward, one split of their gradients backward), which costs far less than the loop's kernel launches
    (docs/benchmarks.md). Written here: megatron's own grouped experts need TransformerEngine (TEGroupedMLP) or the
    grouped_gemm package (GroupedMLP), which these machines lack. Configurations it does not cover (biases, an
    activation other than SwiGLU, probabilities on the input, fp8) run megatron's loop."""

    def _covered(self) -> bool:
        c = self.config
        return (c.gated_linear_unit and c.activation_func is torch.nn.functional.silu and not c.add_bias_linear
                and not c.moe_apply_probs_on_input and c.activation_func_clamp_value is None
                and not c.glu_linear_offset and not (c.fp8 or c.fp4))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._covered():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert), 0).to(x.device, torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        h = _ContiguousGrad.apply(torch.nn.functional.grouped_mm(x.to(fc1.dtype), fc1, offs=offsets))
        gate, up = h.chunk(2, dim=-1)
        a = (torch.nn.functional.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(h.dtype)
        return _ContiguousGrad.apply(torch.nn.functional.grouped_mm(a, fc2, offs=offsets)), None


class MoE(MoELayer):
    """megatron's MoELayer on TP-replicated [s, b, H] hidden states, with ``TokenGather`` as its dispatcher and the
    token count padded to be equal over the EP group (module docstring); megatron's shared experts (when configured)
    run on the unpadded tokens and add to the routed output, as in MoELayer. Returns (output [s, b, H], None)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:  # megatron's layers build the MoE layer without one: the global groups
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.token_dispatcher = TokenGather(self.num_local_experts, self.local_expert_indices, config=self.config,
                                            pg_collection=pg_collection)

    def _common_token_count(self, n: int, device) -> int:
        if self.ep_group.size() == 1:
            return n
        count = torch.tensor([n], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ep_group)
        return int(count)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None or padding_mask is not None:
            raise ValueError("train=megatron's MoE layer takes whole [s, b, H] hidden states without a padding mask")
        s, b, h = hidden_states.shape
        n = s * b
        tokens = hidden_states.reshape(n, 1, h)
        shared = self.shared_experts_compute(tokens)  # None without shared experts
        padded = self._common_token_count(n, hidden_states.device)
        if padded > n:
            tokens = torch.nn.functional.pad(tokens, (0, 0, 0, 0, 0, padded - n))
        probs, routing_map = self.route(tokens)
        tokens, probs = self.preprocess(tokens, probs, routing_map)
        tokens, probs = self.dispatch(tokens, probs)
        out, bias = self.routed_experts_compute(tokens, probs)
        out = self.postprocess(self.combine(out), None)[:n]
        if shared is not None:
            out = out + shared
        return out.reshape(s, b, h), bias
