"""algo=sft's loss on the trainers: SftLoss through either backend takes the steps a plain transformers SFT loop takes
on the same batches (the warm start's loop, model/warm_start.sft: mean NLL of the answer tokens and EOS, AdamW at
1e-3 with betas (0.9, 0.999), no clipping), losses equal to 1e-5 over 12 steps of the tiny model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.data.tasks import addition
from slime_hydra.config import compose, to_config
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.model.tiny import build_tiny_tokenizer
from slime_hydra.model.warm_start import _encode
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.train.megatron.backend import MegatronBackend
from slime_hydra.train.objectives import SftLoss
from tests.train.harness import run_ranks

STEPS, BATCH = 12, 16


def _plain_loop(path, rows) -> tuple[list[float], list]:
    """The losses of the warm start's loop on ``rows``, and each step's batch as the trainers take it."""
    tok = build_tiny_tokenizer()
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    net.train()
    losses, batches = [], []
    for step in range(STEPS):
        ids, mask = _encode(tok, rows[step * BATCH:(step + 1) * BATCH], True)
        logits = net(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        lengths, answers = (ids != tok.pad_token_id).sum(1).tolist(), mask.sum(1).int().tolist()
        batches.append(collate([ids[i, :n].tolist() for i, n in enumerate(lengths)], answers,
                               [[1] * a for a in answers], pad_id=tok.pad_token_id))
    return losses, batches


def _trainer_losses(rank, world, path, batches, kind):
    train = TrainConfig(dtype="fp32", lr=1e-3, adam_beta2=0.999, clip_grad=0.0, micro_batch_samples=BATCH)
    backend = (MegatronBackend if kind == "megatron" else FSDPBackend)(path, train, total_steps=STEPS, device="cpu")
    loss = SftLoss(AlgoConfig(name="sft", objective="sft"), max_response_tokens=8)
    return [float(backend.train_step(batch, loss)["sft_loss"]) for batch in batches]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """model=tiny's random init with its character tokenizer (what the warm start trains)."""
    tok = build_tiny_tokenizer()
    return build_random_checkpoint(to_config(compose([])).model, tmp_path_factory.mktemp("tiny") / "m", seed=0,
                                   tokenizer=tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None)


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_sft_on_the_trainer_takes_the_plain_loops_steps(path, kind):
    want, batches = _plain_loop(path, addition.sft_rows(STEPS * BATCH, seed=0))
    got = run_ranks(1, _trainer_losses, path, batches, kind)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[-1] < 0.8 * got[0]
