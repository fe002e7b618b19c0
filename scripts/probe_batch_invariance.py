#!/usr/bin/env python
"""Which operations give a row the same bits whatever else shares the call: the question algo.true_on_policy and
deterministic=true rest on (slime_hydra/model/invariant.py), asked of this machine's kernels.

    PYTHONPATH=. python3 scripts/probe_batch_invariance.py                      # CPU, fp32
    PYTHONPATH=. python3 scripts/probe_batch_invariance.py --device cuda --dtype bf16

For each operation, a reference call over --rows rows, then calls over 1, 2, 3, 5, 8, 17, 64 and 100 of those rows
(at several offsets); prints how many rows of the small calls differ from the same rows of the reference call, and
by how much at most. Shapes are Qwen2.5-0.5B's (hidden 896, MLP 4864, 14 query heads over 2 key/value heads of 64,
vocabulary 151,936) and the tiny model's (hidden 128, MLP 384, 4 heads over 2 of 32, vocabulary 64).

    linear K->N        F.linear (what every projection is by default)
    tiled_linear K->N  model/invariant.tiled_linear (matmuls of one row count)
    rms_mean           x.float().pow(2).mean(-1) (RMSNorm's reduction)
    rms_tree           model/invariant.tree_sum of the squares / hidden (the batch-invariant RMSNorm's)
    log_softmax        model/invariant.scaled_log_softmax over the vocabulary
    sdpa_batch g/d     the decode form of attention (q [rows, kv_heads, group, d], a masked window): rows of a small
                       batch against the same rows of a large one
    sdpa_rows g/d      the same through model/invariant.sdpa_rows (calls of one row count)
    sdpa_window g/d    the same rows with a window twice as wide (the masked columns added)
"""

import argparse
import json

import torch
import torch.nn.functional as F

from slime_hydra.model.invariant import scaled_log_softmax, sdpa_rows, tiled_linear, tree_sum

SIZES = (1, 2, 3, 5, 8, 17, 64, 100)
LINEARS = [(896, 4864), (896, 128), (4864, 896), (896, 151936), (128, 384), (128, 64)]
ATTENTION = [(2, 7, 64, 512), (2, 2, 32, 128)]
"""(kv heads, query heads per kv head, head width, window)."""
VOCAB = 151936


def compare(full: torch.Tensor, part_of) -> dict:
    """Rows of calls over SIZES rows (``part_of(start, stop)``) against the same rows of ``full``."""
    rows, differing, worst = 0, 0, 0.0
    for size in SIZES:
        for start in range(0, full.shape[0] - size + 1, max(1, (full.shape[0] - size) // 4)):
            part = part_of(start, start + size)
            same = part.reshape(size, -1) == full[start:start + size].reshape(size, -1)
            rows += size
            differing += int((~same.all(-1)).sum())
            worst = max(worst, float((part.float() - full[start:start + size].float()).abs().max()))
    return {"rows": rows, "differing_rows": differing, "max_abs_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=args.device).to(dtype)

    results = {}
    with torch.no_grad():
        for k, n in LINEARS:
            x, w = rand(args.rows, k), rand(n, k) / k ** 0.5
            results[f"linear {k}->{n}"] = compare(F.linear(x, w), lambda a, b: F.linear(x[a:b], w))
            results[f"tiled_linear {k}->{n}"] = compare(tiled_linear(x, w), lambda a, b: tiled_linear(x[a:b], w))
        x, logits = rand(args.rows, 896), rand(args.rows, VOCAB) * 3
        results["rms_mean"] = compare(x.float().pow(2).mean(-1, keepdim=True),
                                      lambda a, b: x[a:b].float().pow(2).mean(-1, keepdim=True))
        results["rms_tree"] = compare(tree_sum(x.float().pow(2)) / 896,
                                      lambda a, b: tree_sum(x[a:b].float().pow(2)) / 896)
        results["log_softmax"] = compare(scaled_log_softmax(logits, 0.7),
                                         lambda a, b: scaled_log_softmax(logits[a:b], 0.7))
        for kv_heads, group, dim, window in ATTENTION:
            q = rand(args.rows, kv_heads, group, dim)
            k, v = rand(args.rows, kv_heads, 2 * window, dim), rand(args.rows, kv_heads, 2 * window, dim)
            positions = torch.randint(0, window, (args.rows,), generator=g, device=args.device)
            mask = (torch.arange(2 * window, device=args.device)[None, :] <= positions[:, None])[:, None, None, :]

            def attend(a, b, width, fn):
                return fn(q[a:b], k[a:b, :, :width], v[a:b, :, :width], mask[a:b, ..., :width])

            def plain(q_, k_, v_, m_):
                return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_)

            def rows(q_, k_, v_, m_):
                return sdpa_rows(q_, k_, v_, m_, None)

            tag = f"{group}/{dim}"
            results[f"sdpa_batch {tag}"] = compare(attend(0, args.rows, window, plain),
                                                   lambda a, b: attend(a, b, window, plain))
            results[f"sdpa_rows {tag}"] = compare(attend(0, args.rows, window, rows),
                                                  lambda a, b: attend(a, b, window, rows))
            results[f"sdpa_window {tag}"] = compare(attend(0, args.rows, window, rows),
                                                    lambda a, b: attend(a, b, 2 * window, rows))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    for name, row in results.items():
        print(json.dumps({"op": name, "device": device, "dtype": args.dtype, **row}))


if __name__ == "__main__":
    main()
