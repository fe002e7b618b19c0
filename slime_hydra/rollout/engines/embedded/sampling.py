"""Next tokens and their logprobs from logits: pure functions of the logits and each request's sampling parameters.

Logprobs are ``log_softmax(logits / T)``, T = 1 for greedy requests (the package docstring defines them). Truncation
works on a descending-sorted copy of a row's probabilities ``p_(1) >= p_(2) >= ...`` and keeps rank r (1-based) when
``r <= top_k``, the mass before it ``p_(1) + ... + p_(r-1) < top_p`` and ``p_(r) >= min_p * p_(1)``; the most likely
token always survives. A token is one multinomial draw from the kept, unnormalised probabilities, through the
request's own generator when it has a ``sampling_seed``.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from slime_hydra.model.invariant import scaled_log_softmax
from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams


def score_prompt(r: Request, logits: torch.Tensor) -> None:
    """input_token_logprobs: each prompt token's logprob given the ones before it (same scaling as outputs);
    ``logits`` [len(prompt) - 1, vocab] are the predictions of prompt tokens 1..."""
    lp = scaled_log_softmax(logits, 1.0 if r.params.greedy else r.params.temperature)
    targets = torch.tensor(r.prompt_ids[1:], device=lp.device)
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    r.input_logprobs = ([None] + chosen)[r.logprob_start_len:]
    if r.top_logprobs_num:
        vals, idx = lp.topk(r.top_logprobs_num, dim=-1)
        tops = [list(zip(v, t)) for v, t in zip(vals.tolist(), idx.tolist())]
        r.input_top = ([None] + tops)[r.logprob_start_len:]


SEARCH_BLOCKS = 32
"""``fused_draw`` cuts each row of logits into this many blocks, so that its passes over the vocabulary run rows x
blocks in parallel (one row per thread block left an H200 mostly idle: docs/benchmarks.md)."""


def fused_draw(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain case of ``sample`` (every row drawn at its temperature, nothing truncated, no per-request
    generator), written to be torch.compiled. Returns (tokens, their logprobs ``x_t / T - logsumexp(x / T)``, x the
    logits upcast to fp32).

    One uniform U per row, and the token is the first whose cumulative probability exceeds U (inverse CDF), which
    is one draw from ``softmax(x / T)`` as ``torch.multinomial`` makes. The row is cut into ``SEARCH_BLOCKS`` blocks
    (padded with zero-probability columns): one pass gives each block's mass ``m_b = sum exp(x / T - top)`` (top the
    row's maximum), their running sum picks the block holding U, and a second pass runs the running sum inside that
    block only. Written by hand because the obvious forms were slow: Gumbel-max (``argmax(x / T + G)``) needs a
    random number per logit (0.30-0.40 ms of a 2.5 ms decode step at 256 x 151,936 logits on an H200, in every
    form tried), and torch.multinomial an exponential one per logit."""
    rows, vocab = logits.shape
    width = -(-vocab // SEARCH_BLOCKS)
    scaled = logits.float() / temperature[:, None]
    blocks = F.pad(scaled, (0, width * SEARCH_BLOCKS - vocab), value=-math.inf).view(rows, SEARCH_BLOCKS, width)
    top = blocks.amax(dim=(1, 2))
    mass = torch.exp(blocks - top[:, None, None]).sum(dim=-1)  # [rows, blocks]
    edges = F.pad(mass.cumsum(dim=-1), (1, 0))  # [rows, blocks + 1]: the mass before each block, then the total
    target = torch.rand(rows, device=logits.device) * edges[:, -1]  # < the total: some block passes it
    block = (edges[:, 1:] <= target[:, None]).sum(dim=-1)
    before, after = edges.gather(1, torch.stack([block, block + 1], dim=1)).unbind(dim=1)
    # the target's place in its block, as a fraction of the block's mass (below 1 by at least 2 ulps, so that the
    # block's own running sum, rounded otherwise, still passes it)
    fraction = ((target - before) / (after - before)).clamp(max=1 - 2 ** -23)
    inside = torch.exp(blocks.gather(1, block[:, None, None].expand(rows, 1, width))[:, 0] - top[:, None])
    running = inside.cumsum(dim=-1)
    index = (running <= (fraction * running[:, -1])[:, None]).sum(dim=-1)
    tokens = block * width + index
    return tokens, scaled.gather(1, tokens[:, None])[:, 0] - (top + torch.log(edges[:, -1]))


class Drawn:
    """One step's draws: the tokens on the device (the next step's inputs), and their ids, logprobs and top logprobs
    on their way to the host (a non-blocking copy into pinned memory, so the device may already run the next step
    when the host reads them: ``result``)."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor, reqs: list[Request],
                 tops: Optional[tuple[torch.Tensor, torch.Tensor]]):
        self.tokens = tokens
        self._widths = [r.top_logprobs_num for r in reqs]
        packed = [torch.stack([tokens.to(chosen.dtype), chosen])]  # exact: token ids < 2^24 fit in fp32
        if tops is not None:
            packed += [tops[0], tops[1].to(tops[0].dtype)]
        self._event = None
        if tokens.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in packed]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def result(self) -> tuple[list[int], list[float], Optional[list]]:
        """(token ids, their logprobs, per-row top logprobs or None): waits for this step's copy only."""
        if self._event is not None:
            self._event.synchronize()
        both = self._host[0].tolist()
        tops = None
        if len(self._host) > 1:
            vals, idx = self._host[1].tolist(), self._host[2].tolist()
            tops = [list(zip(vals[i][:w], (int(t) for t in idx[i][:w]))) if w else None
                    for i, w in enumerate(self._widths)]
        return [int(t) for t in both[0]], both[1], tops


def sample(logits: torch.Tensor, reqs: list[Request], fused=None) -> Drawn:
    """Pick each row's next token (nothing waits for the device). fused: the compiled ``fused_draw``, used when every
    row is a plain draw (None: never)."""
    scale = torch.tensor([1.0 if r.params.greedy else float(r.params.temperature) for r in reqs],
                         dtype=torch.float32).to(logits.device, non_blocking=True)
    if fused is not None and all(not r.params.greedy and not r.params.truncates and r.generator is None
                                 and not r.top_logprobs_num for r in reqs):
        tokens, chosen = fused(logits, scale)
        return Drawn(tokens, chosen, reqs, None)
    logits = logits.float()
    logprobs = scaled_log_softmax(logits, scale[:, None])
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if len(sampled) == len(reqs) and not any(r.params.truncates for r in reqs):  # the common case: no copies
        tokens = draw(logprobs.exp(), reqs)
    else:
        tokens = logits.argmax(dim=-1)
        plain = [i for i in sampled if not reqs[i].params.truncates]
        cut = [i for i in sampled if reqs[i].params.truncates]
        if plain:
            index = torch.tensor(plain, device=logits.device)
            tokens[index] = draw(logprobs[index].exp(), [reqs[i] for i in plain])
        if cut:
            index = torch.tensor(cut, device=logits.device)
            probs, order = logprobs[index].exp().sort(dim=-1, descending=True)
            probs = probs * truncation_mask(probs, [reqs[i].params for i in cut])
            picked = draw(probs, [reqs[i] for i in cut])
            tokens[index] = order.gather(1, picked[:, None])[:, 0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    widest = max(r.top_logprobs_num for r in reqs)
    return Drawn(tokens, chosen, reqs, logprobs.topk(widest, dim=-1) if widest else None)


def truncation_mask(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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


def draw(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
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
