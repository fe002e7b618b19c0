"""The model thread's side of the embedded engine: ``ModelRunner`` holds the model, its tokenizer, the running batch
and its slot KV cache, and does all the work that touches them, on the engine's single model worker thread (the
scheduler hands each call over at a step boundary).

``step`` is the one model call of a scheduler iteration (package docstring, Batching): a prefill into the next free
slots or a decode of every running row; each produced token is sampled (``sampling``), appended to its request and
checked against the finish conditions, and finished rows leave the batch (``SlotKV.compact``). A decode step's
tokens are taken in while the next step runs on the device (``_decode``), or by ``settle``. As control operations
it loads weight updates (into the live parameters, or into the parked host copy while released; with LoRA
adapters, ``lora``, the A and B matrices by their saved-adapter keys), parks and restores
the weights, and frees the slot cache and the decode graphs. It also keeps ``weight_version`` (the label of the loaded
weights) and the process groups that distributed weight updates arrive through. It knows nothing of queues or HTTP.
"""

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from slime_hydra.rollout.engines.embedded import stacking
from slime_hydra.rollout.engines.embedded.protocol import Request, RequestError
from slime_hydra.rollout.engines.embedded.routing import RoutingCapture
from slime_hydra.rollout.engines.embedded.sampling import fused_draw, sample, score_prompt
from slime_hydra.rollout.engines.embedded.graphs import PrefillGraphs, StepGraphs, compile_decode_layers
from slime_hydra.rollout.engines.embedded.slots import SlotKV, register_attention
from slime_hydra.weight_transport import adapter_key, destroy_weight_update_group

logger = logging.getLogger("slime_hydra.engine")


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _comparable(value):
    """A config value as compared between adapters: target-module lists in any order."""
    return frozenset(value) if isinstance(value, (list, tuple, set)) else value


def _bump(version: str) -> str:
    return str(int(version) + 1) if version.lstrip("-").isdigit() else "1"


class ModelRunner:
    """A causal LM, its tokenizer and EOS ids, the running batch in its KV slots, and the weights' version label."""

    def __init__(self, model_path: str, device: str, dtype: str, max_batch_size: int, context_length: Optional[int],
                 tokenizer_path: Optional[str], weight_version: str, cuda_graph: bool, lora: Optional[dict] = None,
                 return_routed_experts: bool = False, torch_compile: Optional[bool] = None):
        """torch_compile: compile the decoder layers' decode step (``graphs.compile_decode_layers``) and the plain
        sampler (None: on CUDA for models without MoE layers). lora: a PEFT LoRA adapter config (adapter_config.json's
        dict): its adapters are added to the model (B = 0, so the function is still the base model's until an update
        sets them) and kept in fp32, as the trainer's PEFT model keeps them: each adapted linear computes
        W x + (lora_alpha / r) B A x on the upcast input.
        return_routed_experts: record the experts every MoE layer chose for every token run (routing.py)."""
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
        self.lora = lora
        """The adapter config the model is served with (None: no adapters)."""
        if lora is not None:
            self._add_adapters(lora)
        self.model.to(self.device).eval().requires_grad_(False)
        self._stacked = stacking.stack(self.model)  # the modules whose sibling projections run as one matmul
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
        self._tensors = self.model.state_dict(keep_vars=True)
        """Name -> parameter/buffer (tied weights appear under each of their names) for loading updates."""
        self._aliases = self._adapter_aliases()
        """Names updates may use for tensors the model holds under PEFT's names (adapter keys, base weights)."""
        self._parked: Optional[dict[int, torch.Tensor]] = None
        """While released: id(parameter) -> its host copy."""
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        """Named adapters (SGLang's /load_lora_adapter): name -> PEFT parameter name -> tensor (fp32, on the device)."""
        self.serving: Optional[str] = None
        """The named adapter whose A and B are in the model's adapter modules; None: the model's own adapter."""
        self._own: Optional[dict[str, torch.Tensor]] = None
        """While a named adapter is served: the model's own adapter (what updates by saved-adapter keys set)."""
        self._groups: dict[str, Any] = {}

        self.running: list[Request] = []
        """The running batch: request b owns KV slot b."""
        self._in_flight: Optional[tuple[list[Request], Any]] = None
        """The decode step launched but not taken in yet: its rows (the batch as it was) and its ``Drawn``."""
        self.kv = SlotKV(self.config, max_batch_size, self.dtype, self.device, self.context_length)
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

    @property
    def released(self) -> bool:
        return self._parked is not None

    def _add_adapters(self, lora: dict) -> None:
        import peft

        # B = 0 whatever the config says of its init: the engine serves the base until the trainer's adapter arrives
        peft.inject_adapter_in_model(peft.LoraConfig(**{**lora, "init_lora_weights": True}), self.model)
        for name, param in self.model.named_parameters():
            if ".lora_" in name:
                param.data = param.data.float()

    def _adapter_aliases(self) -> dict[str, str]:
        """adapter_key(m, X) -> ``m.lora_X.default.weight``; an adapted linear's HF name ``m.weight`` (``m.bias``)
        -> ``m.base_layer.weight`` (``.bias``), so full HF checkpoints still load."""
        aliases = {}
        for name in self._tensors:
            for which in "AB":
                if name.endswith(f".lora_{which}.default.weight"):
                    aliases[adapter_key(name[:-len(f".lora_{which}.default.weight")], which)] = name
            if ".base_layer." in name:
                aliases[name.replace(".base_layer.", ".")] = name
        return aliases

    def holds(self, name: str) -> bool:
        """Whether an update may name this tensor (a model name, or an alias of one)."""
        return self._aliases.get(name, name) in self._tensors

    def load_weights(self, named: dict[str, torch.Tensor], complete: bool) -> None:
        """Copy tensors into the model (or its parked copy); names/shapes are all checked before anything is copied.
        Names are the HF model's, or saved-adapter keys for the adapters of a model served with LoRA.

        complete: every weight of the kind given must be given (a disk reload: the whole model, or the whole
        adapter), counting tied weights once.
        """
        named = {self._aliases.get(name, name): tensor for name, tensor in named.items()}
        problems = []
        for name, tensor in named.items():
            target = self._tensors.get(name)
            if target is None:
                problems.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != tuple(self._shape(target)):
                problems.append(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(self._shape(target))}")
        if complete:
            covered = {id(self._tensors[n]) for n in named if n in self._tensors}
            adapter = all(".lora_" in n for n in named)
            missing = [n for n, t in self._tensors.items() if id(t) not in covered and (".lora_" in n) == adapter]
            if missing:
                problems.append(f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if problems:
            raise RequestError("; ".join(problems[:16]))
        own = {n: t for n, t in named.items() if self._own is not None and n in self._own}
        self._write({n: t for n, t in named.items() if n not in own})
        for name, tensor in own.items():  # a named adapter is in the modules: the model's own waits aside
            self._own[name].copy_(tensor)

    def _write(self, named: dict[str, torch.Tensor]) -> None:
        """Copy tensors, by the model's own names, into the live parameters (or their parked copies)."""
        with torch.no_grad():
            for name, tensor in named.items():
                target = self._tensors[name]
                dest = self._parked_or_live(target)
                dest.copy_(tensor.to(dest.device))

    # -- named adapters (SGLang's LoRA protocol) -------------------------------------------------------------------

    def adapter_problems(self, config: dict) -> list[str]:
        """Why a PEFT adapter_config cannot be served here: the adapter modules are those of ``--lora-config``, so a
        named adapter must have the same rank, alpha and target modules, and be a plain LoRA (no rsLoRA, DoRA or
        trained biases)."""
        if self.lora is None:
            return ["this engine serves no LoRA adapters: start it with --lora-config"]
        problems = [f"{key}={config.get(key)!r} differs from the served adapters' {self.lora.get(key)!r}"
                    for key in ("r", "lora_alpha", "target_modules")
                    if _comparable(config.get(key)) != _comparable(self.lora.get(key))]
        for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
            if config.get(key, plain) != plain:
                problems.append(f"{key}={config[key]!r} is not served (only {key}={plain!r})")
        return problems

    def add_adapter(self, name: str, named: dict[str, torch.Tensor]) -> None:
        """Keep a named adapter (every A and B of the served adapter modules, by saved-adapter keys)."""
        mapped = {self._aliases.get(k, k): t for k, t in named.items()}
        slots = {n: t for n, t in self._tensors.items() if ".lora_" in n}
        problems = [f"unknown adapter weight {k!r}" for k in named if self._aliases.get(k, k) not in slots]
        problems += [f"{n}: shape {tuple(t.shape)} != {tuple(self._shape(slots[n]))}" for n, t in mapped.items()
                     if n in slots and tuple(t.shape) != tuple(self._shape(slots[n]))]
        missing = sorted(set(slots) - set(mapped))
        if missing:
            problems.append(f"missing adapter weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if problems:
            raise RequestError("; ".join(problems[:16]))
        self.adapters[name] = {n: t.to(self.device, torch.float32) for n, t in mapped.items()}

    def drop_adapter(self, name: str) -> None:
        if self.serving == name:
            self.activate(None)
        del self.adapters[name]

    def activate(self, name: Optional[str]) -> None:
        """Put adapter ``name`` (None: the model's own) into the adapter modules, in place (the decode graphs read
        the same storage), before a batch that runs with it."""
        if name == self.serving:
            return
        if self.serving is None:
            self._own = {n: self._parked_or_live(t).clone() for n, t in self._tensors.items() if ".lora_" in n}
        self._write(self._own if name is None else self.adapters[name])
        if name is None:
            self._own = None
        self.serving = name

    def _parked_or_live(self, target: torch.Tensor) -> torch.Tensor:
        return self._parked[id(target)] if self._parked is not None and id(target) in self._parked else target

    def _shape(self, target: torch.Tensor) -> torch.Size:
        return self._parked_or_live(target).shape

    def release(self, tags: list[str]) -> None:
        """Free GPU memory by tag: ``weights`` parks them on the host, ``kv_cache`` frees the slot cache,
        ``cuda_graph`` drops the decode graphs (the cache and graphs come back on the next step, the weights with
        ``resume_weights``). Parking the weights drops the graphs too: the parameters' storage moves."""
        if self.running:
            raise RequestError(f"{len(self.running)} requests are paused in place with a KV cache; abort or retract "
                               "them (pause_generation mode=abort|retract) before releasing memory")
        if "cuda_graph" in tags or "weights" in tags:
            self._drop_graphs()
        if "kv_cache" in tags:
            self.kv.free()
        if "weights" in tags and self._parked is None:
            parked = {}
            for target in self._tensors.values():
                if id(target) not in parked:  # non_blocking: lands in pinned host memory (torch's caching allocator)
                    parked[id(target)] = target.data.to("cpu", non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for target in self._tensors.values():
                target.data = torch.empty(0, dtype=target.dtype, device=self.device)
            stacking.unstack(self._stacked)
            self._parked = parked
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_weights(self) -> None:
        if self._parked is None:
            return
        for target in self._tensors.values():
            if id(target) in self._parked:
                target.data = self._parked[id(target)].to(self.device, non_blocking=True)
        stacking.restack(self._stacked)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._parked = None

    def set_version(self, version: Optional[str], bump: bool) -> None:
        if version is not None:
            self.weight_version = str(version)
        elif bump:
            self.weight_version = _bump(self.weight_version)

    def check_new_group(self, name: str) -> None:
        if name in self._groups:
            raise RequestError(f"weight update group {name!r} exists; destroy it first")

    def add_group(self, name: str, group) -> None:
        self.check_new_group(name)
        self._groups[name] = group

    def group(self, name: str):
        if name not in self._groups:
            raise RequestError(f"no weight update group {name!r}; call /init_weights_update_group first "
                               f"(groups: {sorted(self._groups)})")
        return self._groups[name]

    def drop_group(self, name: str) -> None:
        destroy_weight_update_group(self.group(name))
        del self._groups[name]

    def leave_groups(self) -> None:
        """Destroy every weight update group (the engine is stopping)."""
        for group in self._groups.values():
            destroy_weight_update_group(group)
        self._groups.clear()

    # -- steps -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, admit: list[Request]) -> list[Request]:
        """Prefill the admitted requests into free slots, or (none admitted) decode one token for every row; return
        the requests that finished (they have left the batch)."""
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
