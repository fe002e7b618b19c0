"""Next tokens and their logprobs from logits: pure functions of the logits and each request's sampling parameters.

Logprobs are ``log_softmax(logits / T)``, T = 1 for greedy requests (the package docstring defines them). Truncation
works on a descending-sorted copy of a row's probabilities ``p_(1) >= p_(2) >= ...`` and keeps rank r (1-based) when
``r <= top_k``, the mass before it ``p_(1) + ... + p_(r-1) < top_p`` and ``p_(r) >= min_p * p_(1)``; the most likely
token always survives. A token is one multinomial draw from the kept, unnormalised probabilities, through the
request's own generator when it has a ``sampling_seed``.
"""

import torch

from slime_hydra.rollout.engines.embedded.protocol import Request, SamplingParams


def score_prompt(r: Request, logits: torch.Tensor) -> None:
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


def sample(logits: torch.Tensor, reqs: list[Request]):
    """Pick each row's next token; return (tokens on the device, the same as a list, their logprobs, per-row top
    logprobs or None). One host sync for the tokens and logprobs together."""
    scale = torch.tensor([1.0 if r.params.greedy else float(r.params.temperature) for r in reqs],
                         dtype=logits.dtype).to(logits.device, non_blocking=True)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
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
    tops = None
    widest = max(r.top_logprobs_num for r in reqs)
    if widest:
        vals, idx = logprobs.topk(widest, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        tops = [list(zip(vals[i][:r.top_logprobs_num], idx[i][:r.top_logprobs_num])) if r.top_logprobs_num
                else None for i, r in enumerate(reqs)]
    both = torch.stack([tokens.to(chosen.dtype), chosen]).tolist()  # exact: token ids < 2^24 fit in fp32
    return tokens, [int(t) for t in both[0]], both[1], tops


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
