"""The embedded engine's KV cache: one slot per running request, written in place, plus CUDA graphs of the decode step.

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
  columns 0..P-1 are written into the slots. A row's padding columns hold junk that no query ever sees: decode masks
  columns above ``pos`` and overwrites them as the request grows.
- **Decode** of the first n slots: each row's new key/value goes to column ``pos[b]``; attention reads the columns
  0..window-1 of its slot under the mask ``column <= pos[b]``, the window the power of two (at least
  ``MIN_CAPACITY``, at most the capacity) that holds the longest row, so short rows do not read a long cache. The
  query heads of one KV group share the keys, so they are folded into SDPA's query-length axis
  (q ``[n, kv_heads, group, d]``): no copy of K/V per query head.
- **Finishing**: the rows that stay are compacted into slots 0..n'-1 by moving the last running rows into the holes
  (``compact``), a copy of the moved rows only.
- **Capacity** grows on demand to the next power of two (at least 128, at most the context length); growing copies
  the cache once and drops the CUDA graphs, which hold its address.

Memory is ``slots x capacity x layers x kv_heads x (d_k + d_v) x dtype bytes`` (Qwen2.5-0.5B in bf16: 12 KiB a
token, so 256 slots x 512 tokens = 1.5 GiB). It is made for the small models the embedded engine serves; large
models belong on SGLang's paged cache (``rollout=sglang``).

The attention runs in ``slot_attention``, registered with transformers' ``AttentionInterface`` under
``ATTENTION_NAME`` (the model is loaded with ``attn_implementation=ATTENTION_NAME``); the cache reaches it as the
``slot_kv`` keyword argument of the model call, which transformers passes down to every attention layer. Models with
sliding-window layers, attention sinks or logit soft-capping are refused by it.

CUDA graphs (``DecodeGraphs``): one graph of the whole decode forward (embedding to logits) per batch-size bucket
(1, 2, 4, ... up to the slot count, which is always a bucket) and attention window, captured on first use and
replayed with the live rows'
ids/positions in the static ``ids``/``pos`` buffers; the rows between n and the bucket are idle slots whose results
are ignored. Graphs are dropped whenever a tensor they read moves: the cache grows or is freed, or the weights are
released (a weight update copies into the same storage and keeps them). The decoder layers they capture are
torch.compiled for decode (``compile_decode_layers``) unless the engine runs with ``--torch-compile off``.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F

ATTENTION_NAME = "slime_hydra_slots"
MIN_CAPACITY = 128


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
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    keys, values = slot_kv.write_decode(module.layer_idx, key, value)
    n, heads, _, d = query.shape
    grouped = query.reshape(n, keys.shape[1], heads // keys.shape[1], d)  # query heads of one KV group together
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=slot_kv.mask, scale=scaling)
    return out.reshape(n, 1, heads, values.shape[-1]), None


def register_attention() -> str:
    """Register ``slot_attention`` with transformers. It runs eagerly inside a torch.compiled decoder layer (the
    layer's compiled graphs end before it and resume after it): traced, it would specialise on ``layer_idx`` and
    compile every layer apart."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(slot_attention))
    return ATTENTION_NAME


def compile_decode_layers(layers) -> None:
    """torch.compile each decoder layer for decode steps (prefills, whose widths vary, stay eager: compiled, a prefill
    was no faster, docs/benchmarks.md). A 0.5B model's decode step is ~1,500 small kernels, most of them the
    elementwise ops of norms, rotary embeddings and the gated MLP that inductor fuses; the slot attention stays eager
    between a layer's compiled graphs (``register_attention``). Layers share one compiled code, dynamic in the batch
    size (compiled once for one row and once for more, ``_without_duck_sizing``), with eager bf16 numerics
    (``emulate_precision_casts``); CUDA graphs then capture the compiled kernels like any others."""
    for layer in layers:
        eager = layer.forward
        compiled = _without_duck_sizing(torch.compile(eager, dynamic=True, options={"emulate_precision_casts": True}))

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            kv = kwargs.get("slot_kv")
            return (_compiled if kv is not None and kv.mode == "decode" else _eager)(*args, **kwargs)

        layer.forward = forward


def _without_duck_sizing(compiled):
    """``compiled`` traced with every dynamic size its own symbol. By default torch.compile gives sizes that are equal
    when it first traces one symbol ("duck sizing"), and guards on that equality: a decode of the full 256 slots
    made the batch size one with the slot count (``position_ids`` is a view of the 256-slot position buffer), so the
    first decode of a smaller batch bucket compiled the layers again, a 1.2 s CUDA graph capture mid-rollout on an
    H200 (docs/benchmarks.md)."""
    from torch.fx.experimental import _config as fx_config

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


class SlotKV:
    """The cache tensor, the per-slot next ids/positions, and the mode of the forward about to run."""

    def __init__(self, config, slots: int, dtype: torch.dtype, device: torch.device, max_capacity: int):
        text = config.get_text_config()
        self.layers = int(text.num_hidden_layers)
        self.kv_heads = int(text.num_key_value_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        latent = getattr(text, "kv_lora_rank", None) is not None  # multi-latent attention (module docstring)
        self.key_dim = int(text.qk_nope_head_dim + text.qk_rope_head_dim) if latent else head_dim
        self.value_dim = int(text.v_head_dim) if latent else head_dim
        self.slots, self.dtype, self.device, self.max_capacity = slots, dtype, device, max_capacity
        self.k: Optional[torch.Tensor] = None
        """[layers, slots, kv_heads, capacity, key_dim]."""
        self.v: Optional[torch.Tensor] = None
        """[layers, slots, kv_heads, capacity, value_dim]."""
        self.ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        self._rows = torch.arange(slots, device=device)
        self._columns: Optional[torch.Tensor] = None
        self.mode = "decode"
        self.start = 0
        """prefill: the first slot written."""
        self.window = 0
        """decode: the columns attention reads (``window_for``)."""
        self.mask: Optional[torch.Tensor] = None
        """decode: ``[n, 1, 1, window]``, True where a column holds one of the row's tokens."""
        self.on_move: Callable[[], None] = lambda: None
        """Called when the cache tensor is reallocated or freed (the engine drops its CUDA graphs)."""

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
        capacity = min(max(MIN_CAPACITY, 1 << (length - 1).bit_length()), self.max_capacity)
        grown = [torch.zeros(self.layers, self.slots, self.kv_heads, capacity, d, dtype=self.dtype, device=self.device)
                 for d in (self.key_dim, self.value_dim)]
        if self.k is not None:
            grown[0][..., :self.capacity, :] = self.k
            grown[1][..., :self.capacity, :] = self.v
        self.k, self.v = grown
        self._columns = torch.arange(capacity, device=self.device)
        self.on_move()

    def free(self) -> None:
        if self.k is not None:
            self.k = self.v = None
            self._columns = None
            self.on_move()

    def prefill(self, start: int) -> None:
        self.mode, self.start = "prefill", start

    def window_for(self, length: int) -> int:
        """The attention window of a decode whose longest row has ``length`` tokens (the new one included)."""
        return min(self.capacity, max(MIN_CAPACITY, 1 << (length - 1).bit_length()))

    def decode(self, n: int, window: int) -> None:
        """Set up a decode of slots 0..n-1 reading columns 0..window-1 (inside a CUDA graph capture the mask is
        computed by the graph)."""
        self.mode, self.window = "decode", window
        self.mask = (self._columns[None, :window] <= self.pos[:n, None])[:, None, None, :]

    def write_prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        m, _, length, _ = key.shape
        self.k[layer, self.start:self.start + m, :, :length] = key
        self.v[layer, self.start:self.start + m, :, :length] = value

    def write_decode(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = key.shape[0]
        rows, pos = self._rows[:n], self.pos[:n]
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer[rows, :, pos] = key[:, :, 0]
        v_layer[rows, :, pos] = value[:, :, 0]
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


class GraphCaptureError(RuntimeError):
    """The decode step cannot be captured as a CUDA graph (it synchronises with the host, e.g. a MoE layer whose
    expert kernels read token counts back; transformers' fp32 grouped-matmul fallback does)."""


class DecodeGraphs:
    """CUDA graphs of ``forward(n, window) -> logits [n, vocab]`` for batch-size buckets and attention windows,
    captured on first use."""

    def __init__(self, forward: Callable[[int, int], torch.Tensor], max_batch: int):
        self.forward = forward
        self.buckets = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.captures = 0
        """How many graphs were captured in all (drops make this grow)."""

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def drop(self) -> None:
        self._graphs.clear()
        self._pool = None

    def run(self, n: int, window: int) -> torch.Tensor:
        """Logits of the first n slots (the graph of n's bucket and this window; captured now if it is new)."""
        key = (self.bucket(n), window)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(*key)
            except RuntimeError as error:
                raise GraphCaptureError(f"capturing the decode step of {key[0]} rows: {error}") from error
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:n]

    def _capture(self, size: int, window: int):
        # Warm up on a side stream (cuBLAS handles, lazy inits), as torch.cuda.graph's documentation asks. The
        # warm-up writes the same keys/values the replay will write, so running it changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(size, window)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is barred from unsafe CUDA calls while it captures. A weight update
        # receives its tensors in another thread while generation goes on (server.py; async mode), and under the
        # default "global" mode its allocations and NCCL calls failed the capture ("operation not permitted when
        # stream is capturing"). That thread works on its own streams, so it cannot leak into this graph.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.forward(size, window)
        self.captures += 1
        return graph, logits
