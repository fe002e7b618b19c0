"""A single-turn generate hook to copy: the rollout writes an answer prefix the policy does not sample, then the
policy samples the rest in one /generate call, with sampling settings the data row may adjust.

    rollout.generate=slime_hydra.rollout.examples.answer_prefix.answer_prefix_generate

What it shows, in the order a hook does it (docs/rollout.md, "Hook API reference"):

- the prefix (``"Answer: "``) is appended as response tokens with ``loss_mask`` 0 and ``rollout_log_probs`` 0.0: it
  counts against the response budget, the reward reads it in ``response``, and the policy is not trained on it;
- ``sample.metadata["sampling"]`` (a dict in the row, e.g. ``{"temperature": 0.6}`` or ``{"ignore_eos": true}``)
  overrides this sample's SGLang sampling parameters; the budget stays the rollout's;
- ``apply_output`` appends the model's tokens, logprobs, weight version and status;
- nothing is written to the sample until the engine has answered, so a call that raises leaves it as it was (the
  manager retries unreachable engines from the sample it passed);
- a sample recycled after an abort arrives with its prefix and partial answer and is continued, not restarted.

Copy it into your package and change ``__call__``; ``AnswerPrefixGenerate(prefix="Final answer:")`` makes a variant.
"""

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.rollout.generate import RolloutContext, apply_output


class AnswerPrefixGenerate:
    """The hook of the module docstring; ``prefix`` is written before the policy's answer, ``metadata_key`` names
    the row's dict of sampling overrides."""

    def __init__(self, prefix: str = "Answer: ", metadata_key: str = "sampling"):
        self.prefix, self.metadata_key = prefix, metadata_key

    async def __call__(self, ctx: RolloutContext, sample: Sample, params: dict) -> Sample:
        prefix = [] if sample.response_length else ctx.tokenizer.encode(self.prefix, add_special_tokens=False)
        tokens = sample.tokens + prefix
        budget = min(params["max_new_tokens"] - sample.response_length - len(prefix),
                     ctx.max_context_tokens - len(tokens))
        if budget <= 0:
            sample.status = Status.TRUNCATED
            return sample
        overrides = dict(sample.metadata.get(self.metadata_key) or {})
        overrides.pop("max_new_tokens", None)  # the budget is the rollout's
        out = await ctx.client.generate(tokens, {**params, **overrides, "max_new_tokens": budget},
                                        return_logprob=True)
        sample.tokens, sample.response_length = tokens, sample.response_length + len(prefix)
        sample.loss_mask = sample.loss_mask + [0] * len(prefix)  # written by the rollout: not trained on
        sample.rollout_log_probs = sample.rollout_log_probs + [0.0] * len(prefix)
        apply_output(sample, out)  # status: stop -> completed, length -> truncated, abort -> aborted
        if prefix:  # apply_output dates only a first response token; the prefix came first here
            sample.weight_version = int(out["meta_info"].get("weight_version", sample.weight_version))
        sample.response = ctx.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        return sample


answer_prefix_generate = AnswerPrefixGenerate()
"""The hook ``rollout.generate=slime_hydra.rollout.examples.answer_prefix.answer_prefix_generate`` names."""
