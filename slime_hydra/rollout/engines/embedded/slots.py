"""The embedded engine's KV cache: one slot per running request, written in place, and the attention that uses it.

Layout
------
``SlotKV.k`` and ``SlotKV.v`` are ``[layers, slots, kv_heads, capacity, d]`` tensors, d the key width and the value
width (equal but for multi-latent attention, whose keys are qk_nope_head_dim + qk_rope_head_dim wide and values
v_head_dim: transformers' DeepseekV3Attention hands the attention function keys and values expanded to every head,
which is what is cached; the compressed latent is not). Running request b owns slot
b (slots 0..n-1 are the running batch, in order); its token at position p lives in column p, so nothing is padded
and nothing moves while it decodes. ``pos[b]`` is the number of its tokens already in the cache, which is also the
position id of its next input ``ids[b]`` (the last sampled token, not yet in the cache).

- **Prefill** of m requests into slots [s, s + m): inputs right-padded to the longest, position ids 0..len-1, plain
  causal attention among the new tokens (SDPA's causal kernel, grouped-query heads native); the keys/values of
  columns 0..P-1 are written into the slots (``prefill(rows)`` names each input row's slot). A row's padding columns
  hold junk that no query ever sees: decode masks columns above ``pos`` and overwrites them as the request grows. A
  CUDA-graph prefill (graphs.py) pads the rows too: their keys/values go to one extra slot, ``scratch``, that no
  request owns.
- **Decode** of the first n slots: each row's new key/value goes to column ``pos[b]``; attention reads the columns
  0..window-1 of its slot under the mask ``column <= pos[b]``, the window the power of two (at least
  ``MIN_CAPACITY``, at most the capacity) that holds the longest row, so short rows do not read a long cache. The
  query heads of one KV group share the keys, so they are folded into SDPA's query-length axis
  (q ``[n, kv_heads, group, d]``): no copy of K/V per query head.
- **Finishing**: the rows that stay are compacted into slots 0..n'-1 by moving the last running rows into the holes
  (``compact``), a copy of the moved rows only.
- **Capacity** grows on demand to the next power of two (at least 128, at most the context length); growing copies
  the cache once and drops the CUDA graphs, which hold its address.

Memory is ``(slots + 1) x capacity x layers x kv_heads x (d_k + d_v) x dtype bytes`` (Qwen2.5-0.5B in bf16: 12 KiB
a token, so 257 slots x 512 tokens = 1.5 GiB). It is made for the small models the embedded engine serves; large
models belong on SGLang's paged cache (``rollout=sglang``).

The attention runs in ``slot_attention``, registered with transformers' ``AttentionInterface`` under
``ATTENTION_NAME`` (the model is loaded with ``attn_implementation=ATTENTION_NAME``); the cache reaches it as the
``slot_kv`` keyword argument of the model call, which transformers passes down to every attention layer. Models with
sliding-window layers, attention sinks or logit soft-capping are refused by it.
"""

from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from slime_hydra.model.invariant import rows_attention, sdpa_rows
from slime_hydra.rollout.engines.embedded import cache_capacity

ATTENTION_NAME = "slime_hydra_slots"


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling=None,
                   dropout: float = 0.0, slot_kv: Optional["SlotKV"] = None, **kwargs):
    """transformers attention function: query ``[b, heads, q, d]``, key ``[b, kv_heads, q, d]``, value
    ``[b, kv_heads, q, d_v]`` (after rotary); returns ``([b, q, heads, d_v], None)``. Without ``slot_kv`` (a plain
    forward, e.g. ``/health_generate`` tests of the model itself) it is causal attention over the given tokens."""
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the embedded engine's slot attention does not implement {name}; serve this "
                                      "model with rollout=sglang")
    if slot_kv is None or slot_kv.mode == "prefill":  # (not traced by torch.compile: register_attention)
        if slot_kv is not None:
            slot_kv.write_prefill(module.layer_idx, key, value)
            if slot_kv.invariant:  # the decode's form, one row per position (model/invariant.py)
                return rows_attention(query, key, value, scaling), None
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    keys, values = slot_kv.write_decode(module.layer_idx, key, value)
    n, heads, _, d = query.shape
    grouped = query.reshape(n, keys.shape[1], heads // keys.shape[1], d)  # query heads of one KV group together
    if slot_kv.invariant:  # the batch-invariant engine: SDPA calls of one shape (model/invariant.py)
        out = sdpa_rows(grouped, keys, values, slot_kv.mask, scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=slot_kv.mask, scale=scaling)
    return out.reshape(n, 1, heads, values.shape[-1]), None


def register_attention() -> str:
    """Register ``slot_attention`` with transformers. It runs eagerly inside a torch.compiled decoder layer (the
    layer's compiled graphs end before it and resume after it): traced, it would specialise on ``layer_idx`` and
    compile every layer apart."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(slot_attention))
    return ATTENTION_NAME


class SlotKV:
    """The cache tensor, the per-slot next ids/positions, and the mode of the forward about to run."""

    def __init__(self, config, slots: int, dtype: torch.dtype, device: torch.device, max_capacity: int,
                 region: Callable[[], ContextManager] = nullcontext, invariant: bool = False):
        """region: the memory region the cache tensors are allocated in (the engine's ``kv_cache``, memory.py);
        invariant: the batch-invariant engine's attention (model/invariant.py): a prefill's in the decode's form, one
        row per position (rows_attention), and every SDPA call of one shape (sdpa_rows)."""
        self.invariant = invariant
        text = config.get_text_config()
        self.layers = int(text.num_hidden_layers)
        self.kv_heads = int(text.num_key_value_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        latent = getattr(text, "kv_lora_rank", None) is not None  # multi-latent attention (module docstring)
        self.key_dim = int(text.qk_nope_head_dim + text.qk_rope_head_dim) if latent else head_dim
        self.value_dim = int(text.v_head_dim) if latent else head_dim
        self.slots, self.dtype, self.device, self.max_capacity = slots, dtype, device, max_capacity
        self.region = region
        self.scratch = slots
        """The extra slot the padding rows of a CUDA-graph prefill write to."""
        self.k: Optional[torch.Tensor] = None
        """[layers, slots + 1, kv_heads, capacity, key_dim]."""
        self.v: Optional[torch.Tensor] = None
        """[layers, slots + 1, kv_heads, capacity, value_dim]."""
        self.ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        self._cells = (torch.arange(slots, device=device)[:, None] * self.kv_heads
                       + torch.arange(self.kv_heads, device=device)[None, :])
        """[slots, kv_heads]: the (slot, head) cell of each row's head in a layer's cache: slot x kv_heads + head."""
        self._columns: Optional[torch.Tensor] = None
        self.mode = "decode"
        self.rows: Optional[torch.Tensor] = None
        """prefill: the slot of each input row."""
        self.window = 0
        """decode: the columns attention reads (``window_for``)."""
        self.mask: Optional[torch.Tensor] = None
        """decode: ``[n, 1, 1, window]``, True where a column holds one of the row's tokens."""
        self.targets: Optional[torch.Tensor] = None
        """decode: ``[n x kv_heads]``, where each row's new key/value goes in a layer's cache seen as
        ``[(slots + 1) x kv_heads x capacity, d]``."""
        self.on_move: Callable[[], None] = lambda: None
        """Called when the cache tensor is reallocated (the engine drops its CUDA graphs)."""

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    @property
    def token_bytes(self) -> int:
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * torch.finfo(self.dtype).bits // 8

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens in every slot (grows to a power of two, keeps what is cached)."""
        if length <= self.capacity:
            return
        if length > self.max_capacity:
            raise ValueError(f"{length} tokens exceed the context length {self.max_capacity}")
        capacity = cache_capacity(length, self.max_capacity)
        with self.region():
            grown = [torch.zeros(self.layers, self.slots + 1, self.kv_heads, capacity, d, dtype=self.dtype,
                                 device=self.device) for d in (self.key_dim, self.value_dim)]
        if self.k is not None:
            grown[0][..., :self.capacity, :] = self.k
            grown[1][..., :self.capacity, :] = self.v
        self.k, self.v = grown
        self._columns = torch.arange(capacity, device=self.device)
        self.on_move()

    def prefill(self, rows: torch.Tensor) -> None:
        """Set up a prefill whose input row i goes to slot ``rows[i]``."""
        self.mode, self.rows = "prefill", rows

    def window_for(self, length: int) -> int:
        """The attention window of a decode whose longest row has ``length`` tokens (the new one included)."""
        return cache_capacity(length, self.capacity)

    def decode(self, n: int, window: int) -> None:
        """Set up a decode of slots 0..n-1 reading columns 0..window-1 (inside a CUDA graph capture the mask is
        computed by the graph)."""
        self.mode, self.window = "decode", window
        self.mask = (self._columns[None, :window] <= self.pos[:n, None])[:, None, None, :]
        self.targets = (self._cells[:n] * self.capacity + self.pos[:n, None]).reshape(-1)

    def write_prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        length = key.shape[2]
        self.k[layer][self.rows, :, :length] = key
        self.v[layer][self.rows, :, :length] = value

    def write_decode(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new key/value (one index_copy_ each: a plain index_put with row and position index
        tensors took 4 us a call on an H200), and return the layer's keys and values of the window."""
        n = key.shape[0]
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer.view(-1, self.key_dim).index_copy_(0, self.targets, key[:, :, 0].reshape(-1, self.key_dim))
        v_layer.view(-1, self.value_dim).index_copy_(0, self.targets, value[:, :, 0].reshape(-1, self.value_dim))
        return k_layer[:n, :, :self.window], v_layer[:n, :, :self.window]

    def compact(self, keep: list[int]) -> list[tuple[int, int]]:
        """Keep these running rows (ascending slot indices) in slots 0..len(keep)-1; return the (src, dst) moves."""
        n_keep = len(keep)
        kept = set(keep)
        holes = [s for s in range(n_keep) if s not in kept]
        movers = [s for s in keep if s >= n_keep]
        moves = list(zip(movers, holes))
        if moves:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            if self.k is not None:
                for cache in (self.k, self.v):
                    cache.index_copy_(1, dst, cache.index_select(1, src))
            self.ids.index_copy_(0, dst, self.ids.index_select(0, src))
            self.pos.index_copy_(0, dst, self.pos.index_select(0, src))
        return moves
