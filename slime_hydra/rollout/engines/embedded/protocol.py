"""The request side of the embedded engine's protocol: what a /generate body may hold and what its answer looks like.

``SamplingParams`` (one prompt's ``sampling_params``, checked field by field), ``Request`` (one prompt's generation
and the future its HTTP handler awaits), ``parse_generate`` (a /generate body -> Requests, one prompt or a batch) and
``response`` (a finished Request -> ``{"text", "output_ids", "meta_info"}``). What each field means is in the package
docstring; checking a prompt against the model (vocabulary, context length, tokenizer) is ``Engine.make_request``.
"""

import asyncio
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch

from slime_hydra import routed_experts

GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this decode greedily (SGLang's threshold)."""


class RequestError(ValueError):
    """A request the engine refuses (answered 400 with the message)."""


# SGLang sampling parameters accepted only at their neutral value (the engine does not implement them).
_NEUTRAL_ONLY = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
                 "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                 "logit_bias": None, "custom_params": None}
# SGLang sampling parameters that do not change the tokens (streaming and detokenizer cosmetics).
_NO_EFFECT = {"spaces_between_special_tokens", "stream_interval"}

# Top-level /generate fields that must be off here, and fields that change nothing (sglang-router fills some in).
_OFF_ONLY = ("stream", "return_hidden_states", "return_entropy", "return_bytes", "background",
             "custom_logit_processor", "image_data", "audio_data", "video_data", "input_embeds", "token_ids_logprob")
_IGNORED_FIELDS = ("model", "log_metrics", "no_logs", "priority", "data_parallel_rank")
_PER_PROMPT_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path",
                      "return_routed_experts")


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
                 generator: Optional[torch.Generator], adapter: Optional[str] = None,
                 return_routed_experts: bool = False):
        self.rid = rid
        self.adapter = adapter
        """The named LoRA adapter it runs with (``lora_path``; None: the model as served)."""
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
        self.routed_experts: Optional[list[torch.Tensor]] = [] if return_routed_experts else None
        """The experts of every position run so far, in chunks [positions, num_layers, top_k] (None: not asked)."""
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

    def append(self, token: int, logprob: float, top, eos_ids: frozenset, context_length: int, tokenizer) -> None:
        """Add a generated token (with its logprob and top logprobs) and check the finish conditions in SGLang's
        order: max_new_tokens, then EOS ids and stop_token_ids (unless ignore_eos), stop strings (decoded with
        ``tokenizer``), the context length."""
        self.output_ids.append(token)
        if self.return_logprob:
            self.output_logprobs.append(logprob)
            if self.top_logprobs_num:
                self.output_top.append(top)
        p = self.params
        if len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = {"type": "length", "length": p.max_new_tokens}
        elif not p.ignore_eos and (token in eos_ids or token in p.stop_token_ids):
            self.finish_reason = {"type": "stop", "matched": token}
        elif p.stop and self._match_stop(tokenizer):
            pass
        elif self.num_tokens >= context_length:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}

    def _match_stop(self, tokenizer) -> bool:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=self.params.skip_special_tokens)
        hits = [(text.find(s), s) for s in self.params.stop if s in text]
        if not hits:
            return False
        start, matched = min(hits)
        self.finish_reason = {"type": "stop", "matched": matched}
        self.text_end = start
        return True


def parse_generate(body: dict, make_request: Callable[..., Request]) -> tuple[list[Request], bool]:
    """The Requests of a /generate body and whether it was a batch (answered with a list). ``make_request`` checks
    and builds one prompt's Request (``Engine.make_request``)."""
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
                ("top_logprobs_num", 0), ("lora_path", None), ("return_routed_experts", None))}
    with_text = bool(body.get("return_text_in_logprobs", False))
    reqs = [make_request(p, columns["sampling_params"][i], columns["rid"][i], columns["return_logprob"][i],
                         columns["logprob_start_len"][i], columns["top_logprobs_num"][i], with_text,
                         columns["lora_path"][i], columns["return_routed_experts"][i])
            for i, p in enumerate(prompts)]
    if len({r.rid for r in reqs}) != len(reqs):
        raise RequestError("rids repeat within the batch")
    return reqs, batched


def response(r: Request, tokenizer, weight_version: str) -> dict:
    """The answer to one prompt of a /generate (``tokenizer`` None: no text; ``weight_version`` the current one)."""
    text = ""
    if tokenizer is not None:
        ids = r.output_ids
        matched = (r.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not r.params.no_stop_trim:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        if r.text_end is not None and not r.params.no_stop_trim:
            text = text[:r.text_end]
    meta = {"id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids), "cached_tokens": 0, "weight_version": weight_version,
            "e2e_latency": time.monotonic() - r.created}
    if r.return_logprob:
        with_text = r.return_text_in_logprobs
        meta["output_token_logprobs"] = _logprob_items(tokenizer, zip(r.output_logprobs, r.output_ids), with_text)
        start = max(r.logprob_start_len, 0)
        prompt_part = r.prompt_ids[start:] if r.input_logprobs is not None else []
        meta["input_token_logprobs"] = _logprob_items(tokenizer, zip(r.input_logprobs or [], prompt_part), with_text)
        if r.top_logprobs_num:
            meta["output_top_logprobs"] = [_logprob_items(tokenizer, top, with_text) for top in r.output_top]
            meta["input_top_logprobs"] = [None if top is None else _logprob_items(tokenizer, top, with_text)
                                          for top in (r.input_top or [])]
    if r.routed_experts is not None:  # the positions run: all but the last output token, which was never an input
        meta["routed_experts"] = (routed_experts.encode(torch.cat(r.routed_experts)[:max(r.num_tokens - 1, 0)])
                                  if r.routed_experts else "")  # aborted before its prefill
    return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}


def _token_text(tokenizer, token: int) -> Optional[str]:
    return tokenizer.decode([token]) if tokenizer is not None else None


def _logprob_items(tokenizer, pairs, with_text: bool) -> list:
    return [[lp, t, _token_text(tokenizer, t) if with_text else None] for lp, t in pairs]
