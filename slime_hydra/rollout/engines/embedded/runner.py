"""The model thread's side of the embedded engine: ``ModelRunner`` holds the model, its tokenizer, the running batch
and its slot KV cache, and does all the work that touches them, on the engine's single model worker thread (the
scheduler hands each call over at a step boundary).

``step`` is the one model call of a scheduler iteration (package docstring, Batching): a prefill into the next free
slots or a decode of every running row; each produced token is sampled (``sampling``), appended to its request and
checked against the finish conditions, and finished rows leave the batch (``SlotKV.compact``). A decode step's
tokens are taken in while the next step runs on the device (``_decode``), or by ``settle``. As control operations
it releases and resumes its memory (memory.py: the weights and the slot cache, at stable addresses, so the CUDA
graphs survive); its ``weights`` (weights.py) load updates, serve named LoRA adapters and keep the process groups
that distributed updates arrive through. It also keeps ``weight_version``, the label of the loaded weights. It knows
nothing of queues or HTTP.
"""

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from slime_hydra.model.invariant import make_batch_invariant
from slime_hydra.rollout.engines.embedded.protocol import Request, RequestError
from slime_hydra.rollout.engines.embedded.routing import RoutingCapture
from slime_hydra.rollout.engines.embedded.sampling import fused_draw, sample, score_prompt
from slime_hydra.rollout.engines.embedded.graphs import PrefillGraphs, StepGraphs, compile_decode_layers
from slime_hydra.rollout.engines.embedded.memory import Releasable
from slime_hydra.rollout.engines.embedded.slots import SlotKV, register_attention
from slime_hydra.rollout.engines.embedded.weights import Weights, add_adapters

logger = logging.getLogger("slime_hydra.engine")


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _bump(version: str) -> str:
    return str(int(version) + 1) if version.lstrip("-").isdigit() else "1"


class ModelRunner:
    """A causal LM, its tokenizer and EOS ids, the running batch in its KV slots, and the weights' version label."""

    def __init__(self, model_path: str, device: str, dtype: str, max_batch_size: int, context_length: Optional[int],
                 tokenizer_path: Optional[str], weight_version: str, cuda_graph: bool, lora: Optional[dict] = None,
                 return_routed_experts: bool = False, torch_compile: Optional[bool] = None,
                 batch_invariant: bool = False):
        """torch_compile: compile the decoder layers' decode step (``graphs.compile_decode_layers``) and the plain
        sampler (None: on CUDA for models without MoE layers). lora: a PEFT LoRA adapter config (adapter_config.json's
        dict): its adapters are added to the model (B = 0, so the function is still the base model's until an update
        sets them) and kept in fp32, as the trainer's PEFT model keeps them: each adapted linear computes
        W x + (lora_alpha / r) B A x on the upcast input.
        return_routed_experts: record the experts every MoE layer chose for every token run (routing.py).
        batch_invariant (algo.true_on_policy, deterministic): every token computed as the trainer computes it,
        whatever shares its batch (model/invariant.py): tiled linears, tree-summed norms, prefill attention in the
        decode's form, no stacked projections, nothing compiled (CUDA graphs replay the same kernels: kept)."""
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        from slime_hydra.model.hf import load_tokenizer

        self.model_path = str(Path(model_path).resolve())
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.model_path)
        self.dtype = self._resolve_dtype(dtype, config)
        text = config.get_text_config()
        for plain in ("final_logit_softcapping", "logit_scale"):
            if getattr(text, plain, None) not in (None, 1.0):
                raise ValueError(f"{config.model_type}: {plain}={getattr(text, plain)} is not implemented by the "
                                 "embedded engine (its logits are the LM head's); serve this model with rollout=sglang")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                          attn_implementation=register_attention())
        if lora is not None:
            add_adapters(self.model, lora)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            make_batch_invariant(self.model)
            torch_compile = False
        self.model.eval().requires_grad_(False)
        self.memory = Releasable(self.device)
        """The weights' and the KV cache's device memory, which a release gives back (memory.py)."""
        self.weights = Weights(self.model, self.memory, lora, stack=not batch_invariant)
        """The weights by name (placed on the device here): updates, named adapters, weight-update groups."""
        self._body, self._head = self.model.get_decoder(), self.model.get_output_embeddings()
        self.config = self.model.config
        self.vocab_size = int(text.vocab_size)
        self.context_length = context_length or int(text.max_position_embeddings)

        tok_dir = Path(tokenizer_path or self.model_path)
        self.tokenizer = load_tokenizer(tok_dir) if _has_tokenizer(tok_dir) else None
        self.tokenizer_path = str(tok_dir) if self.tokenizer is not None else None
        eos = [self.config.eos_token_id]
        if (Path(self.model_path) / "generation_config.json").exists():
            eos.append(GenerationConfig.from_pretrained(self.model_path).eos_token_id)
        if self.tokenizer is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(t for item in eos for t in (item if isinstance(item, (list, tuple)) else [item])
                                 if isinstance(t, int))

        self.weight_version = weight_version

        self.running: list[Request] = []
        """The running batch: request b owns KV slot b."""
        self._in_flight: Optional[tuple[list[Request], Any]] = None
        """The decode step launched but not taken in yet: its rows (the batch as it was) and its ``Drawn``."""
        self.kv = SlotKV(self.config, max_batch_size, self.dtype, self.device, self.context_length,
                         lambda: self.memory.region("kv_cache"), invariant=batch_invariant)
        self.routing = RoutingCapture(self._body, max_batch_size, self.device) if return_routed_experts else None
        """Each MoE layer's choice of experts in the last model call (None: not recorded)."""
        moe = any(getattr(text, key, None) for key in ("num_experts", "n_routed_experts", "num_local_experts"))
        self.compiled = (self.device.type == "cuda" and not moe) if torch_compile is None else torch_compile
        if self.compiled:
            compile_decode_layers(self._body.layers)
        self._fused_sample = torch.compile(fused_draw) if self.compiled else None
        """The compiled plain sampler (``sampling.fused_draw``; None: not compiled)."""
        graphed = cuda_graph and self.device.type == "cuda"
        self.graphs = StepGraphs(self._decode_forward, max_batch_size, "decode") if graphed else None
        self.prefill_graphs = (PrefillGraphs(self._prefill_forward, self._head, max_batch_size, self.device)
                               if graphed else None)
        self.kv.on_move = self._drop_graphs
        self.peak_running = 0
        """Most rows ever decoded together (shows that batching happened)."""

    def _resolve_dtype(self, name: str, config) -> torch.dtype:
        if name != "auto":
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        if self.device.type == "cpu":
            return torch.float32
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved, None)
        return saved if saved in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16

    # -- weights and memory ----------------------------------------------------------------------------------------

    def release(self, tags: list[str]) -> None:
        """Give back the device memory of ``tags`` (memory.TAGS: ``weights``, ``kv_cache``) until ``resume``; the
        weights keep a host copy (updates meanwhile go there), the cache's contents are dropped. Addresses stay, so
        the CUDA graphs and the cache's capacity survive; ``cuda_graph`` (SGLang's tag) drops nothing."""
        if self.running:
            raise RequestError(f"{len(self.running)} requests are paused in place with a KV cache; abort or retract "
                               "them (pause_generation mode=abort|retract) before releasing memory")
        self.memory.release(tags)

    def resume(self, tags: list[str]) -> None:
        self.memory.resume(tags)

    def set_version(self, version: Optional[str], bump: bool) -> None:
        if version is not None:
            self.weight_version = str(version)
        elif bump:
            self.weight_version = _bump(self.weight_version)

    # -- steps -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, admit: list[Request]) -> list[Request]:
        """Prefill the admitted requests into free slots, or (none admitted) decode one token for every row; return
        the requests that finished (they have left the batch). A KV cache given back alone (weights resumed for a
        colocated weight sync) is taken back first."""
        self.memory.resume(["kv_cache"])
        if admit:
            done = self.settle()
            self._prefill(admit)
            self.peak_running = max(self.peak_running, len(self.running))
            return done + self._drop_finished()
        return self._decode()

    @torch.no_grad()
    def settle(self) -> list[Request]:
        """Take in the decode step still in flight (``_decode``) and drop the rows that finished; return them. The
        scheduler calls this before anything but another decode step touches the batch."""
        if self._in_flight is not None:
            rows, drawn = self._in_flight
            self._in_flight = None
            self._take(rows, drawn)
        return self._drop_finished()

    @property
    def in_flight(self) -> bool:  # a decode step waits to be taken in (settle)
        return self._in_flight is not None

    def clear_batch(self) -> list[Request]:
        """Empty the batch (a step in flight is dropped unread) and return the requests that were in it."""
        batch, self.running, self._in_flight = self.running, [], None
        return batch

    def _drop_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finish_reason is not None]
        if done:
            self._keep_rows([i for i, r in enumerate(self.running) if r.finish_reason is None])
        return done

    def drop_aborted(self) -> list[Request]:
        """End the running requests marked aborted (finish_reason abort) and take them out of the batch (after
        ``settle``)."""
        gone = [r for r in self.running if r.abort_message is not None and r.finish_reason is None]
        for r in gone:
            r.finish_reason = {"type": "abort", "message": r.abort_message}
        self._keep_rows([i for i, r in enumerate(self.running) if r.finish_reason is None])
        return gone

    def _keep_rows(self, rows: list[int]) -> None:
        """Keep these rows of the running batch; the KV slots follow (SlotKV.compact)."""
        running = self.running
        kept = [running[i] if i < len(rows) else None for i in range(len(rows))]
        for src, dst in self.kv.compact(rows):
            kept[dst] = running[src]
        self.running = kept

    def _prefill(self, reqs: list[Request]) -> None:
        """Run prompt (+ tokens so far, for a retracted request) of each admitted request into the next free slots,
        replaying a CUDA graph when ``PrefillGraphs.width`` allows."""
        seqs = [r.prompt_ids + r.output_ids for r in reqs]
        lengths = [len(s) for s in seqs]
        start = len(self.running)
        slots = list(range(start, start + len(seqs)))
        graphed = self.prefill_graphs is not None and self.routing is None and not any(
            r.wants_input_logprobs for r in reqs)  # those read the hidden states of every position
        padded = self.prefill_graphs.width(len(seqs), max(lengths), self.context_length) if graphed else None
        width = padded or max(lengths)
        self.kv.reserve(width)
        if padded is not None:
            logits = self.prefill_graphs.run(seqs, slots, self.kv.scratch, width)
        else:
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=self.device)  # right-padded
            hidden = self._prefill_forward(ids, torch.tensor(slots, device=self.device))
            last = torch.tensor(lengths, device=self.device) - 1
            logits = self._head(hidden[torch.arange(len(seqs), device=self.device), last])
            if self.routing is not None:  # a re-prefilled (retracted) request's experts start again from here
                routed = self.routing.prefill_rows(len(seqs), width)
                for i, r in enumerate(reqs):
                    if r.routed_experts is not None:
                        r.routed_experts = [routed[i, :lengths[i]]]
            for i, r in enumerate(reqs):
                if r.wants_input_logprobs:
                    score_prompt(r, self._head(hidden[i, :len(r.prompt_ids) - 1]).float())
        logits = logits.float()
        drawn = sample(logits, reqs)
        rows = slice(start, start + len(reqs))
        self.kv.pos[rows] = torch.tensor(lengths, device=self.device)
        self.kv.ids[rows] = drawn.tokens
        self.running = self.running + list(reqs)
        for r in reqs:
            if r.params.max_new_tokens == 0:
                r.finish_reason = {"type": "length", "length": 0}
        self._take(reqs, drawn)

    def _prefill_forward(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Hidden states [rows, width, hidden] of right-padded sequences ``ids`` (column p is position p), each row's
        keys and values written to its slot (what a prefill CUDA graph captures)."""
        self.kv.prefill(slots)
        positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        return self._body(input_ids=ids, position_ids=positions, slot_kv=self.kv, use_cache=False).last_hidden_state

    def _decode(self) -> list[Request]:
        """One decode step, launched before the host takes in the previous step's tokens (``_in_flight``; the
        inputs are on the device already), so the device runs while the host appends tokens and checks finishes. A
        row that finished in the previous step runs once more (its token is dropped). Not launched ahead when a row
        reaches a length limit with the previous token, nor when routed experts are recorded (their buffer is read
        after every step). Returns the requests that finished."""
        done = []
        ahead = self._in_flight is not None and self.routing is None and not any(
            len(r.output_ids) + 1 >= r.params.max_new_tokens or r.num_tokens + 1 >= self.context_length
            for r in self.running)
        if not ahead:
            done = self.settle()
            if not self.running:
                return done
        rows = list(self.running)
        n = len(rows)
        longest = max(r.num_tokens for r in rows) + (1 if ahead else 0)  # the newest token's column + 1
        self.kv.reserve(longest)
        window = self.kv.window_for(longest)
        logits = (self.graphs.run if self.graphs is not None else self._decode_forward)(n, window)
        self.kv.pos[:n] += 1
        routed = self.routing.decode_rows(n) if self.routing is not None else None
        drawn = sample(logits, rows, self._fused_sample)
        self.kv.ids[:n] = drawn.tokens
        previous, self._in_flight = self._in_flight, (rows, drawn)
        if routed is not None:
            for i, r in enumerate(rows):
                if r.routed_experts is not None:
                    r.routed_experts.append(routed[i:i + 1])
        if previous is not None:
            self._take(*previous)
        return done + self._drop_finished()

    def _take(self, rows: list[Request], drawn) -> None:
        """Append one step's tokens to its rows' requests (those still unfinished) and check their finishes."""
        tokens, logprobs, tops = drawn.result()
        for i, r in enumerate(rows):
            if r.finish_reason is None:
                r.append(tokens[i], logprobs[i], tops[i] if tops else None, self.eos_ids, self.context_length,
                         self.tokenizer)

    def _decode_forward(self, n: int, window: int) -> torch.Tensor:
        """Logits [n, vocab] (the model's dtype; ``sample`` upcasts) of the next token of slots 0..n-1, attention
        reading columns 0..window-1 (what a CUDA graph captures)."""
        self.kv.decode(n, window)
        if self.routing is not None:
            self.routing.decoding = True
        try:
            hidden = self._body(input_ids=self.kv.ids[:n, None], position_ids=self.kv.pos[:n, None], slot_kv=self.kv,
                                use_cache=False).last_hidden_state
        finally:
            if self.routing is not None:
                self.routing.decoding = False
        return self._head(hidden[:, -1])

    @property
    def step_graphs(self) -> list[StepGraphs]:
        """The decode and prefill graphs (none without CUDA graphs)."""
        return [g for g in (self.graphs, self.prefill_graphs and self.prefill_graphs.graphs) if g is not None]

    def _drop_graphs(self) -> None:
        graphs = self.step_graphs
        if graphs and self.device.type == "cuda":  # a step in flight may still be replaying one
            torch.cuda.synchronize(self.device)
        for g in graphs:
            g.drop()

    # -- descriptions ----------------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(self.config, "model_type", None),
                "architectures": getattr(self.config, "architectures", None)}
