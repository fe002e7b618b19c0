"""How a built model's SFT warm start grows, level by level: the figures that choose ``model.sft_warm_start_steps``.

    python scripts/probe_warm_start.py model=small data=arithmetic data.adaptive.enabled=true reward=task \
        data.adaptive.max_level=6 -- --steps 3000 --every 500

Builds the model option's random init and tokenizer as ``model/warm_start.py`` does (same rows, same levels), runs
the SFT one step at a time with the same loss, and every ``--every`` steps prints, per level of the run's held-out
split: greedy accuracy, the mean reward of ``--samples`` samples at temperature 1 (what GRPO starts from) and pass@k
(the share of problems with a right sample: what GRPO can reinforce). HF ``generate`` on the model's device.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_hydra.config import compose, to_config  # noqa: E402
from slime_hydra.data.dataset import sft_levels, task_levels  # noqa: E402
from slime_hydra.data.tasks import get_env  # noqa: E402
from slime_hydra.model.warm_start import _encode, build_checkpoint, render_prompt  # noqa: E402


def evaluate(net, tok, env, rows, samples: int) -> dict:
    """Per level: (greedy accuracy, mean sampled reward, pass@samples) over rows."""
    tok.padding_side = "left"
    prompts = [render_prompt(tok, r["prompt"], True) for r in rows]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(net.device)
    out = {}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=net.device.type == "cuda"):
        greedy = net.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
        sampled = net.generate(**batch, max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               num_return_sequences=samples, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)
    width = batch["input_ids"].shape[1]
    g_text = tok.batch_decode(greedy[:, width:], skip_special_tokens=True)
    s_text = tok.batch_decode(sampled[:, width:], skip_special_tokens=True)
    tok.padding_side = "right"
    for i, r in enumerate(rows):
        level = r["metadata"]["level"]
        g = env.score(g_text[i], r["label"], r["metadata"])
        s = [env.score(t, r["label"], r["metadata"]) for t in s_text[i * samples:(i + 1) * samples]]
        acc = out.setdefault(level, [0, 0.0, 0.0, 0])
        acc[0] += g
        acc[1] += sum(s) / samples
        acc[2] += float(max(s) > 0)
        acc[3] += 1
    return {level: (a[0] / a[3], a[1] / a[3], a[2] / a[3]) for level, a in sorted(out.items())}


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--eval-per-level", type=int, default=64)
    args = parser.parse_args(argv[split + 1:])
    cfg = to_config(compose(argv[:split] + [f"model.sft_warm_start_steps=0"]))
    model, data = cfg.model, cfg.data
    env = get_env(data.task)
    levels = sft_levels(data)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(tempfile.mkdtemp(prefix="probe_warm_start_"))
    build_checkpoint(model, data.task, out_dir, cfg.seed, data.apply_chat_template, levels)
    from transformers import AutoModelForCausalLM

    from slime_hydra.model.hf import load_tokenizer

    tok = load_tokenizer(out_dir)
    net = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
    print(f"model={model.name}: {sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters, "
          f"tokenizer {len(tok)} tokens, SFT levels {levels}, batch {model.sft_batch_size}, lr {model.sft_lr:g}")
    eval_rows = env.rows("eval", levels=task_levels(data, "eval"), n=args.eval_per_level * len(levels))
    rows = env.sft_rows(args.steps * model.sft_batch_size, seed=cfg.seed, levels=levels)
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=model.sft_lr, weight_decay=0.0)
    start, b = time.time(), model.sft_batch_size
    for step in range(1, args.steps + 1):
        net.train()
        ids, mask = _encode(tok, rows[(step - 1) * b:step * b], data.apply_chat_template)
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = net(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0:
            net.eval()
            t = time.time() - start
            result = evaluate(net, tok, env, eval_rows, args.samples)
            cells = " ".join(f"L{lv}={g:.2f}/{s:.2f}/{p:.2f}" for lv, (g, s, p) in result.items())
            mean = sum(g for g, _, _ in result.values()) / len(result)
            print(f"step {step} ({t:.0f} s) loss {float(loss.detach()):.3f} greedy mean {mean:.3f} | "
                  f"level=greedy/sampled/pass@{args.samples}: {cells}", flush=True)


if __name__ == "__main__":
    main()
