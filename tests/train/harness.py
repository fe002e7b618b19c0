"""Run a function on N gloo ranks (spawned processes) and return every rank's result; tiny model fixtures; the
logprob checks both backends share."""

import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.net import free_port
from slime_hydra.train.batch import collate

TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                   vocab_size=64, max_position_embeddings=128)


def tiny_checkpoint(family: str = "qwen2") -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"tiny_{family}_"))
    cfg = ModelConfig(**{**TINY.__dict__, "family": family})
    return build_random_checkpoint(cfg, out, seed=0)


def toy_batch(n: int = 8, seed: int = 0):
    """n samples: random prompts of 3-6 tokens, responses of 1-5 tokens, advantages +-0.5, one masked token."""
    g = torch.Generator().manual_seed(seed)
    tokens, resp, masks, adv = [], [], [], []
    for i in range(n):
        p, r = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        tokens.append(torch.randint(1, 64, (p + r,), generator=g).tolist())
        resp.append(r)
        masks.append([1] * r if r < 3 else [1, 0] + [1] * (r - 2))
        adv.append([0.5 if i % 2 else -0.5] * r)
    return collate(tokens, resp, masks, pad_id=0, extras={"advantages": adv})


def pg_loss(logp, entropy, mb):
    """-A * logp, token mean under the mask (REINFORCE with given advantages)."""
    m = mb.loss_mask
    loss = -(logp * mb.extras["advantages"] * m).sum() / m.sum().clamp(min=1)
    return loss, {"pg_loss": loss.detach()}


def _entry(rank, world, port, fn, args, queue):
    from slime_hydra.train.backend import init_distributed

    torch.set_num_threads(1)
    os.environ["MASTER_PORT"] = str(port)
    try:
        init_distributed(rank, world, master_port=port)
        result = fn(rank, world, *args)
    except BaseException as error:  # report instead of leaving the parent waiting on the queue
        queue.put((rank, pickle.dumps(RuntimeError(f"rank {rank}: {error!r}"))))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    queue.put((rank, pickle.dumps(result)))  # plain bytes: shared tensors die with the child
    # The result is in the pipe (put returns once written). Leave without the interpreter's teardown: a rank of a
    # two-rank FSDP test was once killed there by "terminate called without an active exception" (SIGABRT, a C++
    # thread left joinable at exit) after it had delivered its result, failing a test whose numbers were all in.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
"""How ranks start. On CPU machines, forked from the fork server that imported torch, transformers and megatron-core
once (tests/conftest.py: ~10-20 s of CPU saved a rank). On a GPU machine the GPU train tests hung under the fork
server (one H200, 2026-11-29, not diagnosed; a preloaded module that touches CUDA would do it, as a forked child
cannot use CUDA after its parent did), so ranks there are spawned, as they were when those tests passed."""


def run_ranks(world: int, fn, *args):
    """[result of rank 0, ..., rank world-1] of fn(rank, world, *args) run under a fresh gloo group. A rank that
    dies without a word (a signal, a crash in C++) fails the call instead of leaving it waiting."""
    ctx = mp.get_context(START_METHOD)
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(_entry, args=(world, free_port(), fn, args, queue), nprocs=world, join=False,
                               start_method=START_METHOD)
    results = {}
    for _ in range(world):  # drain before joining: a big result blocks the pipe
        while queue.empty():
            dead = [(i, p.exitcode) for i, p in enumerate(procs.processes) if p.exitcode not in (None, 0)]
            if dead and queue.empty():  # its last words, if it sent any, are read first
                for p in procs.processes:
                    p.kill()
                raise RuntimeError("ranks died without a result: "
                                   + ", ".join(f"rank {i} exit code {code}" for i, code in dead))
            time.sleep(0.1)
        rank, payload = queue.get()
        results[rank] = pickle.loads(payload)
        if isinstance(results[rank], RuntimeError):
            try:
                procs.join(timeout=30)  # raises the rank's traceback if it exited by then
            except Exception as failure:
                raise results[rank] from failure
            raise results[rank]
    while not procs.join():
        pass
    return [results[r] for r in range(world)]


def hf_response_logprobs(model, batch) -> torch.Tensor:
    """[B, R] response logprobs of a plain HF (or PEFT) model, by hand (position p+j-1 predicts token p+j)."""
    out = torch.zeros(batch.loss_mask.shape)
    for i in range(batch.size):
        n, p = int(batch.attention_mask[i].sum()), int(batch.response_start[i])
        ids = batch.input_ids[i, :n].unsqueeze(0)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        out[i, : n - p] = torch.stack([logp[p + j - 1, ids[0, p + j]] for j in range(n - p)])
    return out


def assert_policy_logprobs(path: Path, current, entropy, ref0, after, ref1) -> None:
    """A backend's logprobs and entropy of toy_batch() [B, R] equal those of a plain transformers forward, computed
    by hand (the logits at position p+j-1 predict token p+j; fp32, 1e-5), zero past each response; at step 0 the
    reference equals the current policy exactly (kl = 0), and after a step the policy moved but the reference
    (``ref1``) did not."""
    from transformers import AutoModelForCausalLM

    batch = toy_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i in range(batch.size):
        n, p = int(batch.attention_mask[i].sum()), int(batch.response_start[i])
        ids = batch.input_ids[i, :n].unsqueeze(0)
        with torch.no_grad():
            logp_all = torch.log_softmax(model(ids).logits[0].float(), -1)
        expected = torch.stack([logp_all[p + j - 1, ids[0, p + j]] for j in range(n - p)])
        torch.testing.assert_close(current[i, : n - p], expected, atol=1e-5, rtol=0)
        assert torch.all(current[i, n - p:] == 0)
        probs = logp_all[p - 1 : n - 1].exp()
        torch.testing.assert_close(entropy[i, : n - p], -(probs * logp_all[p - 1 : n - 1]).sum(-1), atol=1e-5, rtol=0)
    assert torch.equal(current, ref0)  # step 0: kl = 0 exactly
    assert (after - current).abs().max() > 1e-3  # training moved the policy ...
    assert torch.equal(ref1, ref0)  # ... and the reference stayed the initial one
