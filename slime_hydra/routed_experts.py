"""The routed-experts wire format: which experts a MoE model's router chose for each token, as an engine reports it
and the trainer replays it (``algo.routing_replay``).

An engine started with ``--enable-return-routed-experts`` answers every /generate with
``meta_info["routed_experts"]``: base64 of little-endian int32, row-major ``[tokens, num_layers, top_k]``, as SGLang
does. Row t is the input token at position t of the sequence (prompt + response), for every position the engine ran
through the model: prompt + response - 1 rows (the last sampled token is never an input). Layers are all the decoder
layers; a dense layer's row holds -1 (no routed expert), as does any position the trainer should route itself.

Written here, not taken from a library: the format is SGLang's response field, which no package decodes for us.
"""

import base64

import numpy as np
import torch

NO_EXPERT = -1
"""Entry of a dense layer, a padded position, or a position the engine did not report: the trainer routes it."""


def encode(experts: torch.Tensor) -> str:
    """[tokens, num_layers, top_k] integer tensor -> the base64 string of ``meta_info.routed_experts``."""
    if experts.dim() != 3:
        raise ValueError(f"routed experts must be [tokens, num_layers, top_k], got shape {tuple(experts.shape)}")
    return base64.b64encode(experts.to(torch.int32).cpu().numpy().astype("<i4").tobytes()).decode("ascii")


def decode(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """The base64 string of ``meta_info.routed_experts`` -> int16 [tokens, num_layers, top_k]; raises ValueError
    when its size is not a whole number of tokens of that shape (the engine serves another model)."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    width = num_layers * top_k
    if flat.size % width:
        raise ValueError(f"routed experts of {flat.size} entries are not [tokens, {num_layers} layers, top {top_k}]: "
                         "the engine serves a model of another shape")
    if flat.size and (flat.max() >= np.iinfo(np.int16).max or flat.min() < NO_EXPERT):
        raise ValueError(f"routed expert ids out of range [{NO_EXPERT}, {np.iinfo(np.int16).max})")
    return flat.astype(np.int16).reshape(-1, num_layers, top_k)
