"""The embedded engine: a transformers causal LM behind the subset of SGLang's native HTTP protocol slime_hydra uses.

Run ``python -m slime_hydra.rollout.engines.embedded --model-path DIR --port P [--device cpu|cuda] [--dtype ...]
[--max-batch-size N]``. ``DIR`` is a local HF checkpoint directory; its tokenizer is loaded when the directory has
one (then ``text`` prompts, ``stop`` strings and response ``text`` work; without one, send ``input_ids``). The server
binds 127.0.0.1 unless ``--host`` says otherwise. The rollout code talks to this server and to real SGLang servers
the same way, through sglang-router, so field names and response shapes follow SGLang's.

Endpoints
---------
``GET /health`` (200 once the model is loaded), ``GET /health_generate`` (runs a one-token generation),
``GET /model_info`` | ``/get_model_info``, ``GET /server_info`` | ``/get_server_info``, ``GET /get_load``,
``GET /get_weight_version``, ``POST /generate``, ``POST /abort_request``, ``GET|POST /flush_cache``,
``POST /pause_generation``, ``POST /continue_generation``, ``POST /update_weights_from_disk``,
``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
``POST /destroy_weights_update_group``, ``POST /update_weights_from_tensor``, ``POST /release_memory_occupation``,
``POST /resume_memory_occupation``.

/generate
---------
One prompt (``input_ids: [int]`` or ``text: str``) or a batch (``input_ids: [[int]]`` or ``text: [str]``, answered
with a list in the same order). ``sampling_params`` (a dict, or one dict per prompt): ``temperature`` (default 1.0;
below 1e-6 means greedy), ``top_p``, ``top_k`` (-1 disables), ``min_p``, ``max_new_tokens`` (default 128; 0 only
scores the prompt), ``stop`` (strings; need a tokenizer), ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``
(a per-request generator: the same seed gives the same tokens whatever else shares the batch),
``skip_special_tokens``, ``no_stop_trim``. SGLang parameters this engine does not implement (penalties,
``min_new_tokens``, ``n`` > 1, constrained decoding, ``logit_bias``) are refused with 400 unless at their neutral
value; unknown keys are refused too. Top level: ``rid`` (default: a fresh uuid), ``return_logprob``,
``logprob_start_len`` (-1, the default, returns no prompt logprobs), ``top_logprobs_num``,
``return_text_in_logprobs``. The fields sglang-router adds to every request it forwards are accepted.

Each response is ``{"text", "output_ids", "meta_info"}``; ``meta_info`` has ``id``, ``finish_reason``
(``{"type": "length", "length": n}``, ``{"type": "stop", "matched": token_id | "string"}`` or
``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (always 0: no
prefix cache), ``weight_version`` and ``e2e_latency``; with ``return_logprob``: ``output_token_logprobs`` as
``[[logprob, token_id, None], ...]`` (the third item is the token's text with ``return_text_in_logprobs``),
``input_token_logprobs`` (from ``logprob_start_len``; the first prompt token's logprob is None), and with
``top_logprobs_num`` also ``output_top_logprobs`` / ``input_top_logprobs``.

**Logprobs** are ``log_softmax(logits / temperature)`` at the token: the temperature-scaled distribution, before
top-p / top-k / min-p truncation (what slime's trainer recomputes as ``logits / rollout_temperature``). Greedy
requests (temperature 0) report the raw distribution (temperature 1). The output ids include the token that matched
a stop/EOS condition, with its logprob. Finish checks follow SGLang's order: ``max_new_tokens`` first, then (unless
``ignore_eos``, which disables both) EOS ids and ``stop_token_ids``, then stop strings, then the context length.
EOS ids are the union of ``config.json``, ``generation_config.json`` and the tokenizer's.

Batching
--------
A scheduler coroutine owns the running batch and calls the model from one worker thread, one model call per
iteration: either the prefill of newly admitted requests (FIFO, up to ``--max-batch-size`` rows) or one decode step
of the running batch, so new requests join at step boundaries and finished ones leave at once. Each running request
owns a slot of a preallocated KV cache, written in place (``engines/slots.py``: layout, attention, memory). On CUDA
the decode step is replayed from CUDA graphs, one per batch-size bucket, captured on first use
(``--disable-cuda-graph`` runs it eagerly); on one H100 this takes a Qwen2.5-0.5B-shaped model from ~7.4k to ~33k
generated tokens/s at 256 concurrent requests (docs/benchmarks.md). Under greedy decoding a request's tokens match
running it alone (same numbers up to float summation order, checked against ``model.generate`` in the tests).

Aborts, pausing, weight versions
--------------------------------
``/abort_request {"rid"}`` (or ``{"abort_all": true}``) ends a waiting or running request at the next step boundary
with ``finish_reason.type == "abort"`` and the tokens generated so far; a client that disconnects aborts its request.
``/pause_generation {"mode"}``: ``abort`` (default: abort everything, then hold new requests), ``in_place`` (running
requests keep their KV cache and stop stepping) or ``retract`` (running requests drop their KV cache and go back to
the queue with their tokens; continuing re-prefills prompt + tokens so far). ``/continue_generation`` resumes.

``weight_version`` is a string, as in SGLang (``--weight-version``, default "0"). Every update request may set it
(``weight_version``); ``/update_weights_from_disk`` without one bumps an integer version by one (a disk reload is a
whole new policy), while tensor and distributed updates without one leave it alone (they may be one bucket of many,
as in SGLang). An update waits until the running batch drains (new requests are held meanwhile) unless generation is
paused in place, in which case it applies at once and the paused requests continue on the new weights; with
``abort_all_requests`` it aborts them first. ``meta_info.weight_version`` is the version when the response was made.

Weight transport: ``/update_weights_from_tensor`` takes ``serialized_named_tensors: [base64 safetensors]``, or with
``load_format: "cuda_ipc"`` a JSON list of CUDA IPC handles to the trainer's buffers on the same GPU (see
``engines/weights.py``; no pickle either way). ``/update_weights_from_distributed`` receives
``names``/``dtypes``/``shapes`` broadcast from rank 0 of the group made by ``/init_weights_update_group``
(``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``: gloo on CPU, nccl
on GPU). Tensors may be any subset of
the model's state dict (buckets); ``/update_weights_from_disk {"model_path"}`` must cover every weight.

``/release_memory_occupation`` (needs an empty running batch: pause with ``abort`` or ``retract`` first) parks the
weights: on CUDA they move to host memory and the GPU cache is emptied; on CPU the parameters are emptied and the
same host tensors are kept (nothing is freed, the state machine is the same). While released, requests wait in the
queue; weight updates write into the parked copy. ``/resume_memory_occupation`` puts the weights back. The
``kv_cache`` tag frees the slot cache and ``cuda_graph`` the decode graphs; both come back with the next step (the
graphs are captured again, as they are after any release of the weights: the parameters' storage moved).
"""

import argparse
import asyncio
import logging
import os
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from aiohttp import web

from slime_hydra.rollout.engines.slots import DecodeGraphs, SlotKV, register_attention
from slime_hydra.rollout.engines.weights import (
    decode_named_tensors, destroy_weight_update_group, init_weight_update_group, open_cuda_bucket, recv_named_tensors,
)

logger = logging.getLogger("slime_hydra.engine")

GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this decode greedily (SGLang's threshold)."""

PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class RequestError(ValueError):
    """A request the engine refuses (answered 400 with the message)."""


# ---------------------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------------------

# SGLang sampling parameters accepted only at their neutral value (the engine does not implement them).
_NEUTRAL_ONLY = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
                 "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                 "logit_bias": None, "custom_params": None}
# SGLang sampling parameters that do not change the tokens (streaming and detokenizer cosmetics).
_NO_EFFECT = {"spaces_between_special_tokens", "stream_interval"}

# Top-level /generate fields that must be off here, and fields that change nothing (sglang-router fills some in).
_OFF_ONLY = ("stream", "return_hidden_states", "return_entropy", "return_bytes", "background", "lora_path",
             "custom_logit_processor", "image_data", "audio_data", "video_data", "input_embeds", "token_ids_logprob")
_IGNORED_FIELDS = ("model", "log_metrics", "no_logs", "priority", "data_parallel_rank")
_PER_PROMPT_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, raw: Optional[dict]) -> "SamplingParams":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - set(_NEUTRAL_ONLY) - _NO_EFFECT)
        if unknown:
            raise RequestError(f"unknown sampling_params {unknown}; supported: {sorted(known)}")
        unsupported = [f"{k}={raw[k]!r}" for k, neutral in _NEUTRAL_ONLY.items()
                       if raw.get(k) is not None and raw[k] != neutral]
        if unsupported:
            raise RequestError(f"the embedded engine does not implement {', '.join(unsupported)}")
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            problems.append(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r} must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            problems.append(f"top_k={self.top_k!r} must be >= 1, or -1 to disable")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p={self.min_p!r} must be in [0, 1]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop={self.stop!r} must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(isinstance(t, int) for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            problems.append(f"sampling_seed={self.sampling_seed!r} must be an integer")
        if problems:
            raise RequestError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p / min-p cut the distribution (sampling then goes through a sorted copy)."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0


class Request:
    """One prompt's generation: its inputs, what it has produced so far, and the future its handler awaits."""

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, return_logprob: bool,
                 logprob_start_len: int, top_logprobs_num: int, return_text_in_logprobs: bool,
                 generator: Optional[torch.Generator]):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.return_text_in_logprobs = return_text_in_logprobs
        self.generator = generator
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: Optional[list[Optional[float]]] = None
        self.input_top: Optional[list[Optional[list[tuple[float, int]]]]] = None
        self.finish_reason: Optional[dict] = None
        self.text_end: Optional[int] = None
        """Character index where a matched stop string starts (the response text is cut there)."""
        self.abort_message: Optional[str] = None
        self.created = time.monotonic()
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


# ---------------------------------------------------------------------------------------------------------------------
# The engine: model, scheduler, control operations
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class _Control:
    """A model-thread operation the scheduler runs at a step boundary (weights, memory)."""
    fn: Callable[[], Any]
    drain: bool
    """Wait until the running batch is empty, unless generation is paused in place."""
    future: asyncio.Future


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _bump(version: str) -> str:
    return str(int(version) + 1) if version.lstrip("-").isdigit() else "1"


class Engine:
    """A causal LM with a dynamic-batching scheduler; the HTTP layer (``build_app``) is a thin shell around it."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", max_batch_size: int = 64,
                 context_length: Optional[int] = None, tokenizer_path: Optional[str] = None,
                 weight_version: str = "0", host: str = "127.0.0.1", port: int = 0, cuda_graph: bool = True):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        from slime_hydra.model.hf import load_tokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
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
        self.model.to(self.device).eval().requires_grad_(False)
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

        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.host, self.port = host, port
        self._tensors = self.model.state_dict(keep_vars=True)
        """Name -> parameter/buffer (tied weights appear under each of their names) for loading updates."""
        self._parked: Optional[dict[int, torch.Tensor]] = None
        """While released: id(parameter) -> its host copy."""
        self._groups: dict[str, Any] = {}

        self.paused = False
        self._waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}
        self._running: list[Request] = []
        """The running batch: request b owns KV slot b."""
        self.kv = SlotKV(self.config, max_batch_size, self.dtype, self.device, self.context_length)
        self.graphs = (DecodeGraphs(self._decode_forward, max_batch_size)
                       if cuda_graph and self.device.type == "cuda" else None)
        self.kv.on_move = self._drop_graphs
        self._controls: deque[_Control] = deque()
        self._abort_pending = False
        self._retract_pending = False
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._dead: Optional[str] = None
        self.generated_tokens = 0
        self.peak_running = 0
        """Most rows ever decoded together (shows that batching happened)."""
        self.started = time.time()

    def _resolve_dtype(self, name: str, config) -> torch.dtype:
        if name != "auto":
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        if self.device.type == "cpu":
            return torch.float32
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved, None)
        return saved if saved in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._schedule_forever(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A step may still be running on the model thread: fail the futures, leave its batch alone.
        self._fail_everything("engine shutting down", clear_batch=False)
        for group in self._groups.values():
            destroy_weight_update_group(group)
        self._groups.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._task is not None and not self._task.done()

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the scheduler stopped (None while it runs)."""
        return self._dead

    @property
    def released(self) -> bool:
        return self._parked is not None

    # -- requests --------------------------------------------------------------------------------------------------

    def make_request(self, prompt, params: Optional[dict], rid: Optional[str], return_logprob: bool,
                     logprob_start_len: int, top_logprobs_num: int, return_text_in_logprobs: bool) -> Request:
        """Validate one prompt's fields (RequestError on any problem) and build its Request."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer in the model directory; send input_ids")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = prompt
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            raise RequestError("input_ids must be a non-empty list of integers (or a list of such lists)")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"input_ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.context_length:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context length "
                               f"{self.context_length}")
        sampling = SamplingParams.from_dict(params)
        if sampling.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer in the model directory; use stop_token_ids")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise RequestError(f"logprob_start_len={logprob_start_len!r} must be an integer >= -1")
        if logprob_start_len >= len(prompt_ids):
            raise RequestError(f"logprob_start_len={logprob_start_len} must be below the prompt length "
                               f"{len(prompt_ids)}")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise RequestError(f"top_logprobs_num={top_logprobs_num!r} must be an integer >= 0")
        rid = uuid.uuid4().hex if rid is None else rid
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"rid={rid!r} must be a non-empty string")
        if rid in self._live:
            raise RequestError(f"rid {rid!r} is already running")
        generator = None
        if sampling.sampling_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.sampling_seed)
        return Request(rid, prompt_ids, sampling, bool(return_logprob), logprob_start_len,
                       min(top_logprobs_num, self.vocab_size), bool(return_text_in_logprobs), generator)

    def submit(self, reqs: list[Request]) -> None:
        if not self.healthy:
            raise RuntimeError(f"engine scheduler is down: {self._dead}")
        seen = set()
        for r in reqs:
            if r.rid in self._live or r.rid in seen:
                raise RequestError(f"rid {r.rid!r} is already running")
            seen.add(r.rid)
        for r in reqs:
            self._live[r.rid] = r
            self._waiting.append(r)
        self._wake.set()

    def abort(self, rid: Optional[str] = None, abort_all: bool = False, message: str = "aborted by request") -> int:
        """Mark requests to end at the next step boundary; return how many were marked."""
        targets = list(self._live.values()) if abort_all else [self._live[rid]] if rid in self._live else []
        for r in targets:
            if r.abort_message is None and r.finish_reason is None:
                r.abort_message = message
        if targets:
            self._abort_pending = True
            self._wake.set()
        return len(targets)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r}; choose one of {PAUSE_MODES}")
        self.paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            self._retract_pending = True  # the batch belongs to the model thread until the step boundary
        self._wake.set()

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def load(self) -> dict:
        running = self._running
        tokens = sum(r.num_tokens for r in running)
        running = len(running)
        return {"dp_rank": 0, "num_reqs": running + len(self._waiting), "num_waiting_reqs": len(self._waiting),
                "num_tokens": tokens}

    # -- control operations (weights, memory) ----------------------------------------------------------------------

    async def control(self, fn: Callable[[], Any], drain: bool) -> Any:
        """Run ``fn`` on the model thread at a step boundary (after the batch drains when ``drain``)."""
        if not self.healthy:
            raise RuntimeError(f"engine scheduler is down: {self._dead}")
        op = _Control(fn, drain, asyncio.get_running_loop().create_future())
        self._controls.append(op)
        self._wake.set()
        return await op.future

    def load_weights(self, named: dict[str, torch.Tensor], complete: bool) -> None:
        """Copy tensors into the model (or its parked copy); names/shapes are all checked before anything is copied.

        complete: every weight must be given (a disk reload), counting tied weights once.
        """
        problems = []
        for name, tensor in named.items():
            target = self._tensors.get(name)
            if target is None:
                problems.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != tuple(self._shape(target)):
                problems.append(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(self._shape(target))}")
        if complete:
            covered = {id(self._tensors[n]) for n in named if n in self._tensors}
            missing = [n for n, t in self._tensors.items() if id(t) not in covered]
            if missing:
                problems.append(f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if problems:
            raise RequestError("; ".join(problems[:16]))
        with torch.no_grad():
            for name, tensor in named.items():
                target = self._tensors[name]
                dest = self._parked[id(target)] if self._parked is not None and id(target) in self._parked else target
                dest.copy_(tensor.to(dest.device))

    def _shape(self, target: torch.Tensor) -> torch.Size:
        if self._parked is not None and id(target) in self._parked:
            return self._parked[id(target)].shape
        return target.shape

    def release(self, tags: list[str]) -> None:
        """Free GPU memory by tag: ``weights`` parks them on the host, ``kv_cache`` frees the slot cache,
        ``cuda_graph`` drops the decode graphs (the cache and graphs come back on the next step, the weights with
        ``resume_weights``). Parking the weights drops the graphs too: the parameters' storage moves."""
        if self._running:
            raise RequestError(f"{len(self._running)} requests are paused in place with a KV cache; abort or retract "
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
            self._parked = parked
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_weights(self) -> None:
        if self._parked is None:
            return
        for target in self._tensors.values():
            if id(target) in self._parked:
                target.data = self._parked[id(target)].to(self.device, non_blocking=True)
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

    # -- the scheduler ---------------------------------------------------------------------------------------------

    async def _schedule_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                if self._abort_pending:
                    await self._reap_aborted(loop)
                if self._retract_pending:
                    self._retract()
                if self._controls and self._control_may_run():
                    await self._run_control(loop, self._controls.popleft())
                    continue
                # A waiting control op (a weight update) lets the batch drain: nothing new is admitted meanwhile.
                stepping = not self.paused and not self.released
                admit = []
                if stepping and not self._controls:
                    room = self.max_batch_size - len(self._running)
                    while self._waiting and len(admit) < room:
                        admit.append(self._waiting.popleft())
                if admit or (stepping and self._running):
                    await self._run_step(loop, admit)
                    continue
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a scheduler bug must surface as failed requests and a failing /health
            logger.exception("scheduler stopped")
            self._dead = f"{type(exc).__name__}: {exc}"
            self._fail_everything(f"engine scheduler stopped: {self._dead}")

    def _retract(self) -> None:
        """Running requests go back to the queue front with their tokens; re-admission prefills prompt + tokens."""
        self._retract_pending = False
        self._waiting.extendleft(reversed(self._running))
        self._running = []

    def _control_may_run(self) -> bool:
        op = self._controls[0]
        return not op.drain or not self._running or self.paused

    async def _run_control(self, loop, op: _Control) -> None:
        try:
            result = await loop.run_in_executor(self._executor, op.fn)
        except Exception as exc:
            if not op.future.done():
                op.future.set_exception(exc)
        else:
            if not op.future.done():
                op.future.set_result(result)

    async def _run_step(self, loop, admit: list[Request]) -> None:
        try:
            finished = await loop.run_in_executor(self._executor, self._step, admit)
        except Exception as exc:
            # The step's tensors are in an unknown state: fail the requests it touched, keep serving the rest.
            logger.exception("model step failed")
            victims = admit + self._running
            self._running = []
            for r in victims:
                self._fail(r, f"model step failed: {type(exc).__name__}: {exc}")
            return
        for r in finished:
            self._complete(r)

    async def _reap_aborted(self, loop) -> None:
        self._abort_pending = False
        kept = deque()
        for r in self._waiting:
            if r.abort_message is not None:
                r.finish_reason = {"type": "abort", "message": r.abort_message}
                self._complete(r)
            else:
                kept.append(r)
        self._waiting = kept
        if any(r.abort_message is not None for r in self._running):
            gone = await loop.run_in_executor(self._executor, self._drop_aborted)
            for r in gone:
                self._complete(r)

    def _complete(self, r: Request) -> None:
        self._live.pop(r.rid, None)
        self.generated_tokens += len(r.output_ids)
        if not r.future.done():
            r.future.set_result(self._response(r))

    def _fail(self, r: Request, message: str) -> None:
        self._live.pop(r.rid, None)
        if not r.future.done():
            r.future.set_exception(RuntimeError(message))

    def _fail_everything(self, message: str, clear_batch: bool = True) -> None:
        for r in list(self._live.values()):
            self._fail(r, message)
        self._waiting.clear()
        if clear_batch:
            self._running = []
        while self._controls:
            op = self._controls.popleft()
            if not op.future.done():
                op.future.set_exception(RuntimeError(message))

    # -- model-thread work -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def _step(self, admit: list[Request]) -> list[Request]:
        """Prefill the admitted requests into free slots, or (none admitted) decode one token for every row."""
        if admit:
            self._prefill(admit)
            self.peak_running = max(self.peak_running, len(self._running))
        else:
            self._decode()
        return self._drop_finished()

    def _drop_finished(self) -> list[Request]:
        done = [r for r in self._running if r.finish_reason is not None]
        if done:
            self._keep_rows([i for i, r in enumerate(self._running) if r.finish_reason is None])
        return done

    def _drop_aborted(self) -> list[Request]:
        gone = [r for r in self._running if r.abort_message is not None and r.finish_reason is None]
        for r in gone:
            r.finish_reason = {"type": "abort", "message": r.abort_message}
        self._keep_rows([i for i, r in enumerate(self._running) if r.finish_reason is None])
        return gone

    def _keep_rows(self, rows: list[int]) -> None:
        """Keep these rows of the running batch; the KV slots follow (SlotKV.compact)."""
        running = self._running
        kept = [running[i] if i < len(rows) else None for i in range(len(rows))]
        for src, dst in self.kv.compact(rows):
            kept[dst] = running[src]
        self._running = kept

    def _prefill(self, reqs: list[Request]) -> None:
        """Run prompt (+ tokens so far, for a retracted request) of each admitted request into the next free slots."""
        seqs = [r.prompt_ids + r.output_ids for r in reqs]
        lengths = [len(s) for s in seqs]
        width = max(lengths)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)  # right-padded: column p is position p
        ids = ids.to(self.device)
        start = len(self._running)
        self.kv.reserve(width)
        self.kv.prefill(start)
        positions = torch.arange(width, device=self.device).expand(len(seqs), -1)
        hidden = self._body(input_ids=ids, position_ids=positions, slot_kv=self.kv, use_cache=False).last_hidden_state
        last = torch.tensor(lengths, device=self.device) - 1
        logits = self._head(hidden[torch.arange(len(seqs), device=self.device), last]).float()
        for i, r in enumerate(reqs):
            if r.wants_input_logprobs:
                self._score_prompt(r, self._head(hidden[i, :len(r.prompt_ids) - 1]).float())
        tokens, chosen, logprobs, tops = self._sample(logits, reqs)
        rows = slice(start, start + len(reqs))
        self.kv.pos[rows] = torch.tensor(lengths, device=self.device)
        self.kv.ids[rows] = tokens
        for i, r in enumerate(reqs):
            if r.params.max_new_tokens == 0:
                r.finish_reason = {"type": "length", "length": 0}
            else:
                self._append(r, chosen[i], logprobs[i], tops[i] if tops else None)
        self._running = self._running + list(reqs)

    def _decode(self) -> None:
        n = len(self._running)
        self.kv.reserve(max(r.num_tokens for r in self._running))  # the newest token goes to column num_tokens - 1
        logits = self.graphs.run(n) if self.graphs is not None else self._decode_forward(n)
        self.kv.pos[:n] += 1
        tokens, chosen, logprobs, tops = self._sample(logits, self._running)
        self.kv.ids[:n] = tokens
        for i, r in enumerate(self._running):
            self._append(r, chosen[i], logprobs[i], tops[i] if tops else None)

    def _decode_forward(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] (fp32) of the next token of slots 0..n-1 (what a CUDA graph captures)."""
        self.kv.decode(n)
        hidden = self._body(input_ids=self.kv.ids[:n, None], position_ids=self.kv.pos[:n, None], slot_kv=self.kv,
                            use_cache=False).last_hidden_state
        return self._head(hidden[:, -1]).float()

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.drop()

    def _score_prompt(self, r: Request, logits: torch.Tensor) -> None:
        """input_token_logprobs: each prompt token's logprob given the ones before it (same scaling as outputs);
        ``logits`` [len(prompt) - 1, vocab] are the predictions of prompt tokens 1..."""
        scale = 1.0 if r.params.greedy else r.params.temperature
        lp = torch.log_softmax(logits / scale, dim=-1)
        targets = torch.tensor(r.prompt_ids[1:], device=lp.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        r.input_logprobs = ([None] + chosen)[r.logprob_start_len:]
        if r.top_logprobs_num:
            vals, idx = lp.topk(r.top_logprobs_num, dim=-1)
            tops = [list(zip(v, t)) for v, t in zip(vals.tolist(), idx.tolist())]
            r.input_top = ([None] + tops)[r.logprob_start_len:]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Pick each row's next token; return (tokens on the device, the same as a list, their logprobs, per-row top
        logprobs or None). One host sync for the tokens and logprobs together."""
        scale = torch.tensor([1.0 if r.params.greedy else float(r.params.temperature) for r in reqs],
                             dtype=logits.dtype).to(logits.device, non_blocking=True)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(sampled) == len(reqs) and not any(r.params.truncates for r in reqs):  # the common case: no copies
            tokens = self._draw(logprobs.exp(), reqs)
        else:
            tokens = logits.argmax(dim=-1)
            plain = [i for i in sampled if not reqs[i].params.truncates]
            cut = [i for i in sampled if reqs[i].params.truncates]
            if plain:
                index = torch.tensor(plain, device=logits.device)
                tokens[index] = self._draw(logprobs[index].exp(), [reqs[i] for i in plain])
            if cut:
                index = torch.tensor(cut, device=logits.device)
                probs, order = logprobs[index].exp().sort(dim=-1, descending=True)
                probs = probs * self._truncation_mask(probs, [reqs[i].params for i in cut])
                picked = self._draw(probs, [reqs[i] for i in cut])
                tokens[index] = order.gather(1, picked[:, None])[:, 0]
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        tops = None
        widest = max(r.top_logprobs_num for r in reqs)
        if widest:
            vals, idx = logprobs.topk(widest, dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            tops = [list(zip(vals[i][:r.top_logprobs_num], idx[i][:r.top_logprobs_num])) if r.top_logprobs_num
                    else None for i, r in enumerate(reqs)]
        both = torch.stack([tokens.to(chosen.dtype), chosen]).tolist()  # exact: token ids < 2^24 fit in fp32
        return tokens, [int(t) for t in both[0]], both[1], tops

    @staticmethod
    def _truncation_mask(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Which of the descending-sorted probabilities survive each row's top-k, top-p and min-p."""
        rank = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else sorted_probs.shape[1] for p in params],
                             device=sorted_probs.device)
        top_p = torch.tensor([float(p.top_p) for p in params], device=sorted_probs.device, dtype=sorted_probs.dtype)
        min_p = torch.tensor([float(p.min_p) for p in params], device=sorted_probs.device, dtype=sorted_probs.dtype)
        keep = rank < top_k[:, None]
        keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]  # mass before this token is below top_p
        keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
        keep[:, 0] = True
        return keep.to(sorted_probs.dtype)

    @staticmethod
    def _draw(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One multinomial draw per row; seeded requests use their own generator, the rest share the global one."""
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if len(shared) == len(reqs):
            return torch.multinomial(probs, 1)[:, 0]
        picked = torch.empty(len(reqs), dtype=torch.long, device=probs.device)
        if shared:
            index = torch.tensor(shared, device=probs.device)
            picked[index] = torch.multinomial(probs[index], 1)[:, 0]
        for i, r in enumerate(reqs):
            if r.generator is not None:
                picked[i] = torch.multinomial(probs[i], 1, generator=r.generator)[0]
        return picked

    def _append(self, r: Request, token: int, logprob: float, top) -> None:
        r.output_ids.append(token)
        if r.return_logprob:
            r.output_logprobs.append(logprob)
            if r.top_logprobs_num:
                r.output_top.append(top)
        p = r.params
        if len(r.output_ids) >= p.max_new_tokens:
            r.finish_reason = {"type": "length", "length": p.max_new_tokens}
        elif not p.ignore_eos and (token in self.eos_ids or token in p.stop_token_ids):
            r.finish_reason = {"type": "stop", "matched": token}
        elif p.stop and self._match_stop(r):
            pass
        elif r.num_tokens >= self.context_length:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}

    def _match_stop(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        hits = [(text.find(s), s) for s in r.params.stop if s in text]
        if not hits:
            return False
        start, matched = min(hits)
        r.finish_reason = {"type": "stop", "matched": matched}
        r.text_end = start
        return True

    # -- responses -------------------------------------------------------------------------------------------------

    def _token_text(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _logprob_items(self, pairs, with_text: bool) -> list:
        return [[lp, t, self._token_text(t) if with_text else None] for lp, t in pairs]

    def _response(self, r: Request) -> dict:
        text = ""
        if self.tokenizer is not None:
            ids = r.output_ids
            matched = (r.finish_reason or {}).get("matched")
            if isinstance(matched, int) and not r.params.no_stop_trim:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
            if r.text_end is not None and not r.params.no_stop_trim:
                text = text[:r.text_end]
        meta = {"id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.output_ids), "cached_tokens": 0, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - r.created}
        if r.return_logprob:
            with_text = r.return_text_in_logprobs
            meta["output_token_logprobs"] = self._logprob_items(zip(r.output_logprobs, r.output_ids), with_text)
            start = max(r.logprob_start_len, 0)
            prompt_part = r.prompt_ids[start:] if r.input_logprobs is not None else []
            meta["input_token_logprobs"] = self._logprob_items(zip(r.input_logprobs or [], prompt_part), with_text)
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [self._logprob_items(top, with_text) for top in r.output_top]
                meta["input_top_logprobs"] = [None if top is None else self._logprob_items(top, with_text)
                                              for top in (r.input_top or [])]
        return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}

    # -- descriptions ----------------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(self.config, "model_type", None),
                "architectures": getattr(self.config, "architectures", None)}

    def server_info(self) -> dict:
        elapsed = max(time.time() - self.started, 1e-9)
        memory = {}
        if self.device.type == "cuda":
            memory["memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return {**memory, "engine": "slime_hydra.embedded", "model_path": self.model_path,
                "tokenizer_path": self.tokenizer_path, "served_model_name": self.model_path, "host": self.host,
                "port": self.port, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "torch_threads": torch.get_num_threads(), "tp_size": 1, "dp_size": 1,
                "max_running_requests": self.max_batch_size, "context_length": self.context_length,
                "skip_tokenizer_init": self.tokenizer is None, "weight_version": self.weight_version,
                "paused": self.paused, "memory_released": self.released, "cuda_graph": self.graphs is not None,
                "cuda_graph_captures": self.graphs.captures if self.graphs is not None else 0,
                "kv_capacity_tokens": self.kv.capacity,
                "internal_states": [{"generated_tokens": self.generated_tokens, "peak_running_reqs": self.peak_running,
                                     "avg_gen_throughput": self.generated_tokens / elapsed, **self.load()}]}


# ---------------------------------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------------------------------

def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _outcome(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    return body


def _as_request_error(fn: Callable) -> Callable:
    """``fn`` with its ValueErrors (malformed request data) turned into RequestErrors (400)."""
    def wrapped(*args):
        try:
            return fn(*args)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
    return wrapped


def _parse_generate(engine: Engine, body: dict) -> tuple[list[Request], bool]:
    """The Requests of a /generate body and whether it was a batch (answered with a list)."""
    known = {"text", "input_ids", "return_text_in_logprobs", *_PER_PROMPT_FIELDS, *_OFF_ONLY, *_IGNORED_FIELDS}
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown /generate fields {unknown}")
    on = [k for k in _OFF_ONLY if body.get(k)]
    if on:
        raise RequestError(f"the embedded engine does not support {on}")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("give exactly one of text or input_ids")
    if "text" in body:
        prompt = body["text"]
        batched = isinstance(prompt, list)
        if not all(isinstance(p, str) for p in (prompt if batched else [prompt])):
            raise RequestError("text must be a string or a list of strings")
    else:
        prompt = body["input_ids"]
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list)
        if not isinstance(prompt, list) or (batched and not all(isinstance(p, list) for p in prompt)):
            raise RequestError("input_ids must be a list of integers or a list of such lists")
    prompts = prompt if batched else [prompt]
    if not prompts:
        raise RequestError("the batch is empty")

    def column(key: str, default) -> list:
        """A field's value for each prompt: one value shared by all, or (batch only) a list with one per prompt."""
        value = body.get(key)
        value = default if value is None else value
        if batched and isinstance(value, list):
            if len(value) != len(prompts):
                raise RequestError(f"{key} has {len(value)} entries for {len(prompts)} prompts")
            return [default if v is None else v for v in value]
        if batched and key == "rid" and value is not None:
            raise RequestError("rid for a batch must be a list with one id per prompt")
        return [value] * len(prompts)

    columns = {key: column(key, default) for key, default in
               (("sampling_params", None), ("rid", None), ("return_logprob", False), ("logprob_start_len", -1),
                ("top_logprobs_num", 0))}
    with_text = bool(body.get("return_text_in_logprobs", False))
    reqs = [engine.make_request(p, columns["sampling_params"][i], columns["rid"][i], columns["return_logprob"][i],
                                columns["logprob_start_len"][i], columns["top_logprobs_num"][i], with_text)
            for i, p in enumerate(prompts)]
    if len({r.rid for r in reqs}) != len(reqs):
        raise RequestError("rids repeat within the batch")
    return reqs, batched


def build_app(engine: Engine, max_request_mb: int = 4096) -> web.Application:
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request):
        return web.Response(status=200) if engine.healthy else _error(f"scheduler down: {engine.dead_reason}", 503)

    @routes.get("/health_generate")
    async def health_generate(request):
        if not engine.healthy:
            return _error(f"scheduler down: {engine.dead_reason}", 503)
        if engine.paused or engine.released:  # deliberately idle: a probe would wait for continue/resume
            return web.Response(status=200)
        probe = engine.make_request([0], {"max_new_tokens": 1, "temperature": 0}, None, False, -1, 0, False)
        engine.submit([probe])
        try:
            await asyncio.wait_for(asyncio.shield(probe.future), timeout=60)
        except asyncio.TimeoutError:
            engine.abort(probe.rid, message="health probe timed out")
            return _error("a one-token generation did not finish within 60 s", 503)
        return web.Response(status=200)

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info(request):
        return web.json_response(engine.model_info())

    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def server_info(request):
        return web.json_response(engine.server_info())

    @routes.get("/get_load")
    async def get_load(request):
        return web.json_response([engine.load()])

    @routes.get("/get_weight_version")
    async def get_weight_version(request):
        return web.json_response({"weight_version": engine.weight_version})

    @routes.post("/generate")
    async def generate(request):
        reqs, batched = _parse_generate(engine, await _body(request))
        engine.submit(reqs)
        try:
            results = await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # the client went away: stop spending steps on it
            for r in reqs:
                engine.abort(r.rid, message="client disconnected")
            raise
        return web.json_response(results if batched else results[0])

    @routes.post("/abort_request")
    async def abort_request(request):
        body = await _body(request)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid={rid!r} must be a string (or send abort_all: true)")
        n = engine.abort(rid, abort_all=bool(body.get("abort_all", False)))
        return web.json_response({"success": True, "num_aborted": n})

    @routes.get("/flush_cache")
    @routes.post("/flush_cache")
    async def flush_cache(request):
        return _outcome(True, "Cache flushed (the embedded engine keeps no prefix cache).")

    @routes.post("/pause_generation")
    async def pause_generation(request):
        body = await _body(request)
        engine.pause(body.get("mode", "abort"))
        return _outcome(True, f"generation paused (mode={body.get('mode', 'abort')})")

    @routes.post("/continue_generation")
    async def continue_generation(request):
        engine.resume()
        return _outcome(True, "generation continued")

    def abort_first(body: dict) -> None:
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True, message="aborted for a weight update")

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(request):
        body = await _body(request)
        path = body.get("model_path")
        if not path or not Path(path).is_dir():
            raise RequestError(f"model_path={path!r} is not a directory")
        if body.get("load_format") not in (None, "auto"):
            raise RequestError(f"load_format={body['load_format']!r}: the embedded engine reads safetensors/bin")
        abort_first(body)
        named = await asyncio.to_thread(read_checkpoint, path)

        def apply():
            engine.load_weights(named, complete=True)
            engine.set_version(body.get("weight_version"), bump=True)
            engine.model_path = str(Path(path).resolve())

        await engine.control(apply, drain=True)
        logger.info("weights loaded from %s; weight_version %s", path, engine.weight_version)
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors from {path}",
                                  "num_paused_requests": 0, "weight_version": engine.weight_version})

    @routes.post("/init_weights_update_group")
    async def init_weights_update_group(request):
        body = await _body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise RequestError(f"missing fields {missing}")
        name = body.get("group_name", "weight_update_group")
        engine.check_new_group(name)
        backend = body.get("backend") or ("nccl" if engine.device.type == "cuda" else "gloo")
        join = _as_request_error(init_weight_update_group)
        group = await asyncio.to_thread(join, body["master_address"], int(body["master_port"]),
                                        int(body["rank_offset"]), int(body["world_size"]), name, backend,
                                        float(body.get("timeout_s", 300.0)), engine.device)
        engine.add_group(name, group)
        logger.info("joined weight update group %s as rank %s of %s (%s)", name, body["rank_offset"],
                    body["world_size"], backend)
        return _outcome(True, f"joined {name} as rank {body['rank_offset']} of {body['world_size']} ({backend})")

    @routes.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request):
        body = await _body(request)
        name = body.get("group_name", "weight_update_group")
        await asyncio.to_thread(engine.drop_group, name)
        return _outcome(True, f"left {name}")

    @routes.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request):
        body = await _body(request)
        group = engine.group(body.get("group_name", "weight_update_group"))
        if "names" in body:
            names, dtypes, shapes = body["names"], body.get("dtypes"), body.get("shapes")
        elif "name" in body:
            names, dtypes, shapes = [body["name"]], [body.get("dtype")], [body.get("shape")]
        else:
            raise RequestError("give names/dtypes/shapes lists (or name/dtype/shape)")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise RequestError("names, dtypes and shapes must be lists of the same length")
        abort_first(body)
        # Receive while generation goes on (into fresh buffers); only the copy into the model waits for a boundary.
        named = await asyncio.to_thread(_as_request_error(recv_named_tensors), group, names, dtypes, shapes,
                                        engine.device)

        def apply():
            engine.load_weights(named, complete=False)
            engine.set_version(body.get("weight_version"), bump=False)

        await engine.control(apply, drain=True)
        logger.info("%d tensors received by broadcast; weight_version %s", len(named), engine.weight_version)
        return _outcome(True, f"received and loaded {len(named)} tensors")

    @routes.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request):
        body = await _body(request)
        payloads = body.get("serialized_named_tensors")
        fmt = body.get("load_format")
        if fmt not in (None, "cuda_ipc"):
            raise RequestError(f"load_format={fmt!r}: the embedded engine takes its default format (base64 "
                               "safetensors) or cuda_ipc (see engines/weights.py)")
        if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
            raise RequestError("serialized_named_tensors must be a list with one string (the embedded engine has "
                               "one tensor-parallel rank): base64 safetensors, or with load_format=cuda_ipc a JSON "
                               "list of handles")
        abort_first(body)
        if fmt == "cuda_ipc":  # views of the trainer's buffer: load before answering, the sender keeps it alive
            named = _as_request_error(open_cuda_bucket)(payloads[0], engine.device)
        else:
            named = await asyncio.to_thread(_as_request_error(decode_named_tensors), payloads[0])

        def apply():
            engine.load_weights(named, complete=False)
            engine.set_version(body.get("weight_version"), bump=False)
            if fmt == "cuda_ipc":
                torch.cuda.current_stream(engine.device).synchronize()

        await engine.control(apply, drain=True)
        count = len(named)
        named.clear()  # drop the views so the IPC mapping closes now
        logger.info("%d tensors loaded from a request (%s); weight_version %s", count, fmt or "safetensors",
                    engine.weight_version)
        return _outcome(True, f"loaded {count} tensors")

    def memory_tags(body: dict) -> list:
        tags = body.get("tags") or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"unknown tags {unknown}; choose from {MEMORY_TAGS}")
        return tags

    @routes.post("/release_memory_occupation")
    async def release_memory_occupation(request):
        tags = memory_tags(await _body(request))
        await engine.control(lambda: engine.release(tags), drain=True)
        logger.info("released %s", tags)
        return _outcome(True, f"released {tags}")

    @routes.post("/resume_memory_occupation")
    async def resume_memory_occupation(request):
        tags = memory_tags(await _body(request))
        if "weights" in tags:
            await engine.control(engine.resume_weights, drain=False)
            logger.info("weights resumed")
        return _outcome(True, f"resumed {tags}")

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except RequestError as exc:
            if request.path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return _outcome(False, str(exc))
            return _error(str(exc), 400)
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            if request.path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=500)
            return _error(f"{type(exc).__name__}: {exc}", 500)

    app = web.Application(middlewares=[errors], client_max_size=max_request_mb * 1024 * 1024)
    app.add_routes(routes)

    async def on_startup(app):
        await engine.start()

    async def on_cleanup(app):
        await engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (``*.safetensors``, else ``*.bin``), on CPU."""
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        return {name: t for f in files for name, t in load_file(str(f)).items()}
    files = sorted(root.glob("*.bin"))
    if files:
        return {name: t for f in files for name, t in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise RequestError(f"no *.safetensors or *.bin weights in {path}")


class _SkipGrpcProbes(logging.Filter):
    """sglang-router first probes a worker over gRPC (an HTTP/2 preface); aiohttp logs each one as a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model's, if any)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU; on CUDA the checkpoint's dtype, else bfloat16")
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="on CUDA, run the decode step eagerly instead of replaying CUDA graphs")
    parser.add_argument("--context-length", type=int, default=None,
                        help="prompt + response limit in tokens (default: max_position_embeddings)")
    parser.add_argument("--weight-version", default="0", help="initial weight_version string")
    parser.add_argument("--seed", type=int, default=None, help="seed of the shared sampling generator")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads; default: OMP_NUM_THREADS if set, else all cores but one (the "
                             "HTTP loop needs a core: spinning OpenMP workers on every core stall it for seconds)")
    parser.add_argument("--max-request-mb", type=int, default=4096, help="largest request body accepted")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_SkipGrpcProbes())
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    started = time.monotonic()
    engine = Engine(args.model_path, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                    cuda_graph=not args.disable_cuda_graph,
                    context_length=args.context_length, tokenizer_path=args.tokenizer_path,
                    weight_version=args.weight_version, host=args.host, port=args.port)
    logger.info("loaded %s on %s (%s) in %.1f s; tokenizer: %s; pid %d", engine.model_path, engine.device,
                engine.dtype, time.monotonic() - started, engine.tokenizer_path, os.getpid())
    web.run_app(build_app(engine, args.max_request_mb), host=args.host, port=args.port, access_log=None,
                handler_cancellation=True, print=lambda msg: logger.info(msg.strip()))


if __name__ == "__main__":
    main()
