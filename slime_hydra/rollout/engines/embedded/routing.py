"""Which experts the model's routers chose for every token the engine runs (``--enable-return-routed-experts``).

transformers' MoE blocks (qwen3_moe, glm4_moe, deepseek_v3) call a router module ``mlp.gate`` that returns
``(router_logits, weights, expert_indices)``, indices [tokens, top_k]. A forward hook on every layer's router keeps
the indices of the current model call:

- a prefill (eager, [rows, width] right-padded tokens): the indices as they are; ``prefill_rows`` reshapes them to
  [rows, width, num_layers, top_k];
- a decode step (one token per row; maybe a CUDA graph replay): the hook copies them into a preallocated buffer
  [num_layers, max_batch, top_k], so a captured graph writes the same buffer at every replay; ``decode_rows`` reads
  its first n rows.

Dense layers' entries stay ``NO_EXPERT`` (-1). The runner keeps each request's rows (routed_experts.py gives the
layout of the answer).
"""

from functools import partial

import torch

from slime_hydra.routed_experts import NO_EXPERT


def _is_router(module) -> bool:
    return module is not None and isinstance(getattr(module, "top_k", None), int)


class RoutingCapture:
    """Forward hooks on the routers of ``body``'s decoder layers, and the indices of the last model call."""

    def __init__(self, body, max_batch: int, device: torch.device):
        layers = list(body.layers)
        self.routers = {i: layer.mlp.gate for i, layer in enumerate(layers)
                        if _is_router(getattr(getattr(layer, "mlp", None), "gate", None))}
        if not self.routers:
            raise ValueError("--enable-return-routed-experts: the model has no MoE layers (no router to record)")
        self.num_layers = len(layers)
        self.top_k = next(iter(self.routers.values())).top_k
        self.decoding = False
        """Set by the runner around a decode step's forward (what a CUDA graph captures)."""
        self._decode = torch.full((self.num_layers, max_batch, self.top_k), NO_EXPERT, dtype=torch.int32,
                                  device=device)
        self._prefill: dict[int, torch.Tensor] = {}
        for i, router in self.routers.items():
            router.register_forward_hook(partial(self._record, i))

    def _record(self, layer: int, module, args, output) -> None:
        indices = output[2]
        if self.decoding:
            self._decode[layer, :indices.shape[0]].copy_(indices)
        else:
            self._prefill[layer] = indices

    def prefill_rows(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width, num_layers, top_k] int32 on the host: the experts of each position of the last prefill."""
        out = torch.full((rows * width, self.num_layers, self.top_k), NO_EXPERT, dtype=torch.int32)
        for layer, indices in self._prefill.items():
            out[:, layer] = indices.to("cpu", torch.int32)
        self._prefill.clear()
        return out.view(rows, width, self.num_layers, self.top_k)

    def decode_rows(self, n: int) -> torch.Tensor:
        """[n, num_layers, top_k] int32 on the host: the experts of the token each of the first n rows decoded."""
        return self._decode[:, :n].transpose(0, 1).to("cpu", copy=True)  # a copy on CPU too: the buffer is reused

