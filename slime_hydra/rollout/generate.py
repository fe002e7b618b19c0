"""Turning one pending sample into a generated one: the default generate, and user hooks.

A generate function has the signature (a plug-in contract, docs/architecture.md)::

    async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

``ctx`` carries what a hook needs: ``ctx.client`` (an ``SGLangClient`` on the router: every request goes through
it, so embedded engines and SGLang servers are interchangeable), ``ctx.tokenizer``, ``ctx.rollout`` (the rollout
config) and ``ctx.max_context_tokens``. ``sampling_params`` is SGLang's dict (temperature, top_p, top_k,
max_new_tokens ...). A hook fills ``tokens``, ``response``, ``response_length``, ``loss_mask``,
``rollout_log_probs``, ``weight_version`` and ``status`` (and ``routed_experts``, when the engine reports them:
``apply_output`` does all of it for one /generate answer) and returns the sample. ``rollout.generate`` names a hook
by dotted path (``slime_hydra.rollout.examples.calculator_tool.calculator_generate`` is a worked multi-turn example).

The default generate sends ``sample.tokens`` (the prompt, plus the partial response of a recycled sample) with
``return_logprob``, appends the engine's tokens and logprobs, trains on every generated token (loss_mask 1), and
maps SGLang's finish reason to the status: ``stop`` -> completed, ``length`` -> truncated (also when the response
budget is spent), ``abort`` -> aborted (the buffer recycles or drops it). A resumed sample keeps its
``weight_version`` (that of its first token); ``max_new_tokens`` is what is left of the budget.
"""

import hashlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Union

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.dotted import import_callable
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.config import RolloutConfig

GenerateFn = Callable[["RolloutContext", Sample, dict], Awaitable[Union[Sample, list[Sample]]]]


@dataclass
class RolloutContext:
    """What a generate function may use (the first argument of every hook)."""

    rollout: RolloutConfig
    """The rollout config slice."""
    client: SGLangClient
    """Client on the router's URL (SGLang native protocol)."""
    tokenizer: Any
    """The model's HF tokenizer."""
    max_context_tokens: int
    """Prompt + response must fit in this many tokens (model.max_position_embeddings)."""


def sampling_params(rollout: RolloutConfig, **overrides) -> dict:
    """SGLang sampling_params of a training rollout (rollout.temperature, top_p, top_k, max_response_tokens)."""
    params = {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
              "max_new_tokens": rollout.max_response_tokens}
    params.update(overrides)
    return params


def request_seed(*parts) -> int:
    """A request's own sampling seed under deterministic=true: 63 bits of BLAKE2b over the parts' reprs, so the same
    parts (seed, stream, group, sample, weight version) give the same stream of draws, any other parts another."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big") >> 1


FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
"""SGLang meta_info.finish_reason.type -> Sample status."""


def apply_output(sample: Sample, out: dict, loss_mask_value: int = 1) -> Sample:
    """Append one /generate answer (output_ids, output_token_logprobs, finish_reason) to the sample's response."""
    meta = out["meta_info"]
    new_ids = list(out["output_ids"])
    logprobs = [item[0] for item in meta.get("output_token_logprobs", [])]
    if len(logprobs) != len(new_ids):
        raise ValueError(f"engine returned {len(new_ids)} tokens but {len(logprobs)} logprobs "
                         "(was return_logprob set?)")
    if sample.response_length == 0 and new_ids:
        sample.weight_version = int(meta.get("weight_version", sample.weight_version))
    sample.tokens = sample.tokens + new_ids
    sample.response_length += len(new_ids)
    sample.loss_mask = sample.loss_mask + [loss_mask_value] * len(new_ids)
    sample.rollout_log_probs = sample.rollout_log_probs + logprobs
    sample.response = sample.response + out.get("text", "")
    if "routed_experts" in meta:  # covers every position this call ran: the whole sequence so far
        sample.routed_experts = meta["routed_experts"]
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    sample.status = FINISH_STATUS.get(reason, Status.FAILED)
    return sample


async def default_generate(ctx: RolloutContext, sample: Sample, params: dict) -> Sample:
    """One /generate call continuing ``sample.tokens`` within what is left of the response budget."""
    budget = params["max_new_tokens"] - sample.response_length
    budget = min(budget, ctx.max_context_tokens - len(sample.tokens))
    if budget <= 0:
        sample.status = Status.TRUNCATED
        return sample
    out = await ctx.client.generate(sample.tokens, {**params, "max_new_tokens": budget}, return_logprob=True)
    apply_output(sample, out)
    if sample.status is Status.COMPLETED or sample.status is Status.ABORTED:
        return sample
    if sample.response_length >= params["max_new_tokens"]:
        sample.status = Status.TRUNCATED
    return sample


def get_generate_fn(path: str | None) -> GenerateFn:
    """rollout.generate: None for the default, else the async function at the dotted path."""
    if path is None:
        return default_generate
    return import_callable(path, "rollout.generate", "async def generate(ctx, sample, sampling_params)")
