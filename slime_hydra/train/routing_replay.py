"""Routing replay for transformers' MoE modeling (train=fsdp): each router returns the engine's choice of experts.

With ``algo.routing_replay`` the batch carries the experts the engine's routers chose for every position
(``TrainBatch.routed_experts`` [b, s, num_layers, top_k], slime_hydra/routed_experts.py). transformers' MoE blocks
(qwen3_moe, glm4_moe, deepseek_v3) call a router ``mlp.gate`` that returns ``(logits, weights, indices)`` for the
block's [b * s, H] tokens; ``RoutingReplay`` hooks each router's forward so that, inside ``replaying(experts)``, a
position the engine reported takes the engine's indices, and its weights are the family's function of the
trainer's own logits at those indices:

    softmax routers (qwen3_moe):  w_j = p[e_j] / (sum_i p[e_i] if norm_topk_prob else 1),  p = softmax(logits)
    sigmoid routers (glm4_moe, deepseek_v3):
                                   w_j = s[e_j] / (sum_i s[e_i] + 1e-20 if norm_topk_prob else 1) * scaling,
                                   s = sigmoid(logits), scaling = routed_scaling_factor

so gradients still reach the router through the weights (only the choice is replayed). Positions without a report
(-1: padding, a tail the engine never ran) keep the router's own choice and weights, bit for bit. The hooks go on
before the layers are compiled; outside ``replaying`` they change nothing.

Written here: transformers has no hook for replaying a routing decision.
"""

from contextlib import contextmanager
from typing import Optional

import torch

from slime_hydra.routed_experts import NO_EXPERT


def moe_routers(decoder_layers) -> dict[int, torch.nn.Module]:
    """Layer index -> the router of every MoE layer (``mlp.gate`` with an integer ``top_k``)."""
    routers = {}
    for i, layer in enumerate(decoder_layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and isinstance(getattr(gate, "top_k", None), int):
            routers[i] = gate
    return routers


def replayed_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[n, top_k] routing weights of ``indices`` from the router's ``logits`` [n, E], as the router computes them
    for its own choice (module docstring)."""
    if hasattr(router, "e_score_correction_bias"):  # sigmoid scores; the bias only steers the choice
        weights = logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _replay(router: torch.nn.Module, args, output):
    """Forward hook of every router (one function for all layers, so a compiled decoder layer is traced once; the
    layer's target is the router's own ``replay_target`` tensor, [tokens, top_k] or None)."""
    target = router.replay_target
    if target is None:
        return None
    logits, weights, indices = output
    reported = (target != NO_EXPERT).all(dim=-1, keepdim=True)
    indices = torch.where(reported, target, indices)
    return logits, torch.where(reported, replayed_weights(router, logits, indices), weights), indices


class RoutingReplay:
    """A forward hook on the routers of ``decoder_layers`` (module docstring); ``replaying(experts)`` is the switch."""

    def __init__(self, decoder_layers):
        self.routers = moe_routers(decoder_layers)
        if not self.routers:
            raise ValueError("algo.routing_replay: the model has no MoE layers")
        for router in self.routers.values():
            router.replay_target = None
            router.register_forward_hook(_replay)

    @contextmanager
    def replaying(self, experts: Optional[torch.Tensor]):
        """Forwards inside route the tokens of a [b, s] batch as ``experts`` [b, s, num_layers, top_k] says
        (None: the routers choose)."""
        flat = None if experts is None else experts.reshape(-1, *experts.shape[2:]).long()
        for layer, router in self.routers.items():
            router.replay_target = None if flat is None else flat[:, layer]
        try:
            yield
        finally:
            for router in self.routers.values():
                router.replay_target = None
