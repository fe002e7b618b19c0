#!/usr/bin/env python
"""GPU time of one attention block (QKV projection, split, RoPE, SDPA, output projection; forward + backward), each
variant torch.compiled, at the Qwen2.5-0.5B shape (8 x 1,024 tokens, 14 query heads in 2 groups, head dim 64).

    PYTHONPATH=. python3 scripts/bench_attention_layout.py      # one GPU

Variants (same arithmetic, different tensor layouts):
- ``megatron``: megatron-core's split of the fused QKV output, [s, b, groups, (heads_per_group + 2) * d] cut at
  448 / 64 / 64 channels;
- ``heads_view``: the same rows as a [s, b, groups, heads_per_group + 2, d] view (what spec.SelfAttention does);
- ``q_first``: the rows ordered [all q | all k | all v] instead of per group;
- ``batch_first``: transformers' layout, [b, s] from the input on.
All rotate with precomputed cos/sin tables. Prints each variant's kernels and their summed GPU time (the profiler's
kernel durations; the wall time of this small block is host-bound and is not the figure).
"""

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

S, B, HIDDEN, GROUPS, PER_GROUP, D = 1024, 8, 896, 2, 7, 64
HEADS = GROUPS * PER_GROUP


def rotate(t, cos, sin):
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def attend_sequence_first(q, k, v):
    """[s, b, heads, d] in, [s, b, heads * d] out, as spec.SDPACoreAttention."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(S, B, -1)


def megatron(x, w, bias, w_out, cos, sin):
    mixed = (torch.matmul(x, w.t()) + bias).view(S, B, GROUPS, (PER_GROUP + 2) * D)
    q, k, v = torch.split(mixed, [PER_GROUP * D, D, D], dim=3)
    q = q.reshape(S, B, HEADS, D)
    return torch.matmul(attend_sequence_first(rotate(q, cos, sin), rotate(k, cos, sin), v), w_out.t())


def heads_view(x, w, bias, w_out, cos, sin):
    mixed = (torch.matmul(x, w.t()) + bias).view(S, B, GROUPS, PER_GROUP + 2, D)
    q = mixed[:, :, :, :PER_GROUP].reshape(S, B, HEADS, D)
    k, v = mixed[:, :, :, PER_GROUP], mixed[:, :, :, PER_GROUP + 1]
    return torch.matmul(attend_sequence_first(rotate(q, cos, sin), rotate(k, cos, sin), v), w_out.t())


def q_first(x, w, bias, w_out, cos, sin):
    q, k, v = torch.split(torch.matmul(x, w.t()) + bias, [HEADS * D, GROUPS * D, GROUPS * D], dim=-1)
    q, k, v = q.view(S, B, HEADS, D), k.view(S, B, GROUPS, D), v.view(S, B, GROUPS, D)
    return torch.matmul(attend_sequence_first(rotate(q, cos, sin), rotate(k, cos, sin), v), w_out.t())


def batch_first(x, w, bias, w_out, cos, sin):
    q, k, v = torch.split(torch.matmul(x.transpose(0, 1), w.t()) + bias, [HEADS * D, GROUPS * D, GROUPS * D], dim=-1)
    cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)  # [1, s, 1, d]
    q = rotate(q.view(B, S, HEADS, D), cos, sin).transpose(1, 2)
    k = rotate(k.view(B, S, GROUPS, D), cos, sin).transpose(1, 2)
    v = v.view(B, S, GROUPS, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(B, S, -1)
    return torch.matmul(out, w_out.t()).transpose(0, 1)


def main() -> None:
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(S, B, HIDDEN, **kw, requires_grad=True)
    w = (torch.randn(GROUPS * (PER_GROUP + 2) * D, HIDDEN, **kw) * 0.03).requires_grad_()
    bias = (torch.randn(GROUPS * (PER_GROUP + 2) * D, **kw) * 0.1).requires_grad_()
    w_out = (torch.randn(HIDDEN, HIDDEN, **kw) * 0.03).requires_grad_()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(S, device="cuda").float(), inv_freq)
    freqs = torch.cat((freqs, freqs), -1)[:, None, None, :]
    cos, sin = freqs.cos().to(kw["dtype"]), freqs.sin().to(kw["dtype"])
    grad = torch.randn(S, B, HIDDEN, **kw)
    totals = {}
    for name, fn in (("megatron", megatron), ("heads_view", heads_view), ("q_first", q_first),
                     ("batch_first", batch_first)):
        fn = torch.compile(fn)
        for _ in range(3):
            fn(x, w, bias, w_out, cos, sin).backward(grad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x, w, bias, w_out, cos, sin).backward(grad)
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        totals[name] = sum(us for _, us in kernels)
        print(f"== {name}: {totals[name]:.1f} us of kernels ({len(kernels)})")
        for kernel, us in kernels:
            print(f"   {us:7.1f} us  {kernel[:100]}")
    for name, us in totals.items():
        print(f"{name:12s} {us:7.1f} us  ({us / totals['megatron']:.2f} of megatron's)")


if __name__ == "__main__":
    main()
