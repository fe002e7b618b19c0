"""The embedded engine's steps as CUDA graphs, and its decoder layers compiled for decode.

A step graph (``StepGraphs``) is captured per key on first use and replayed after; its inputs are static buffers the
runner fills before each replay:

- **Decode**: one graph of the whole decode forward (embedding to logits) per batch-size bucket (1, 2, 4, ... up to
  the slot count, which is always a bucket) and attention window, replayed with the live rows' ids/positions in
  ``SlotKV``'s static ``ids``/``pos`` buffers; the rows between n and the bucket are idle slots whose results are
  ignored.
- **Prefill** (``PrefillGraphs``): one graph per row bucket and padded width (a power of two, at least
  ``MIN_PREFILL_WIDTH``) of a prefill of at most ``PREFILL_GRAPH_TOKENS`` padded tokens, replayed with the prompts in
  its own static buffers; rows beyond the real ones write their keys and values to the cache's scratch slot and their
  logits are ignored. An eager prefill of 128 16-token prompts was host-bound (23-25 ms in-process, 5 ms of it GPU
  time; docs/benchmarks.md). Prefills that score their prompt (input logprobs), record routed experts or are larger
  run eagerly.

Graphs are dropped whenever a tensor they read moves: the cache grows or is freed, or the weights are released (a
weight update copies into the same storage and keeps them). The decoder layers the decode graphs capture are
torch.compiled for decode (``compile_decode_layers``) unless the engine runs with ``--torch-compile off``.
"""

import logging
from typing import Callable, Optional

import torch

from slime_hydra.rollout.engines.embedded import PREFILL_GRAPH_TOKENS

logger = logging.getLogger("slime_hydra.engine")

MIN_PREFILL_WIDTH = 16


class StepGraphs:
    """CUDA graphs of ``forward(rows, size) -> [rows, ...]`` for row-count buckets and a second size (decode: the
    attention window; prefill: the padded width), captured on first use. A step that cannot be captured (it
    synchronises with the host, e.g. a MoE layer whose expert kernels read token counts back, as transformers' fp32
    grouped-matmul fallback does) runs eagerly from then on; so does every step with ``capture=False``."""

    def __init__(self, forward: Callable[[int, int], torch.Tensor], max_rows: int, step: str, capture: bool = True):
        self.forward = forward
        self.step = step
        """What the graphs run, for messages ("decode", "prefill")."""
        self.buckets = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows})
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.captures = 0
        """How many graphs were captured in all (drops make this grow)."""
        self.failed: Optional[str] = None if capture else "capture=False"
        """Why these steps run eagerly (None: they replay graphs)."""

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def drop(self) -> None:
        self._graphs.clear()
        self._pool = None

    def run(self, n: int, size: int) -> torch.Tensor:
        """The first n rows of the output (the graph of n's bucket and this size; captured now if it is new)."""
        if self.failed is None:
            key = (self.bucket(n), size)
            try:
                if key not in self._graphs:
                    self._graphs[key] = self._capture(*key)
            except RuntimeError as error:
                self.failed = f"capturing the {self.step} step of {key[0]} rows: {error}"
                logger.warning("CUDA graphs off for this engine's %s steps: %s", self.step, self.failed)
                torch.cuda.synchronize()
            else:
                graph, out = self._graphs[key]
                graph.replay()
                return out[:n]
        return self.forward(n, size)

    def _capture(self, rows: int, size: int):
        # Warm up on a side stream (cuBLAS handles, lazy inits), as torch.cuda.graph's documentation asks. The
        # warm-up writes the same keys/values the replay will write, so running it changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(rows, size)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is barred from unsafe CUDA calls while it captures. A weight update
        # receives its tensors in another thread while generation goes on (server.py; async mode), and under the
        # default "global" mode its allocations and NCCL calls failed the capture ("operation not permitted when
        # stream is capturing"). That thread works on its own streams, so it cannot leak into this graph.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.forward(rows, size)
        self.captures += 1
        return graph, out


class PrefillGraphs:
    """Prefills of short prompts as CUDA graphs (module docstring). ``forward(ids [rows, width], slots [rows]) ->
    hidden [rows, width, hidden]`` runs the model body with each input row's keys and values going to its slot;
    ``head`` maps hidden states to logits. ``capture=False`` runs the same padded layout eagerly (the CPU tests); so
    does a prefill that cannot be captured (``StepGraphs``)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], max_rows: int, device: torch.device,
                 capture: bool = True):
        self.forward, self.head = forward, head
        self.graphs = StepGraphs(self._padded, max_rows, "prefill", capture)
        self._ids = torch.zeros(PREFILL_GRAPH_TOKENS, dtype=torch.long, device=device)
        self._slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._last = torch.zeros(max_rows, dtype=torch.long, device=device)

    def width(self, rows: int, longest: int, limit: int) -> Optional[int]:
        """The padded width of a prefill of ``rows`` sequences, the longest ``longest`` tokens (None: too large for a
        graph, or wider than ``limit``, the context length)."""
        width = max(MIN_PREFILL_WIDTH, 1 << (longest - 1).bit_length())
        return width if self.graphs.bucket(rows) * width <= PREFILL_GRAPH_TOKENS and width <= limit else None

    def run(self, seqs: list[list[int]], slots: list[int], scratch: int, width: int) -> torch.Tensor:
        """Logits [len(seqs), vocab] of the token after each sequence's last, its keys and values written to its
        slot (the padding rows' to ``scratch``)."""
        rows = self.graphs.bucket(len(seqs))
        pad = rows - len(seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs] + [[0] * width] * pad)
        self._ids[:rows * width].copy_(ids.view(-1))
        self._slots[:rows].copy_(torch.tensor(slots + [scratch] * pad))
        self._last[:rows].copy_(torch.tensor([len(s) - 1 for s in seqs] + [0] * pad))
        if self.graphs.failed is not None:  # eagerly, in the same padded layout
            return self._padded(rows, width)[:len(seqs)]
        return self.graphs.run(len(seqs), width)

    def _padded(self, rows: int, width: int) -> torch.Tensor:
        hidden = self.forward(self._ids[:rows * width].view(rows, width), self._slots[:rows])
        return self.head(hidden[torch.arange(rows, device=hidden.device), self._last[:rows]])


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
