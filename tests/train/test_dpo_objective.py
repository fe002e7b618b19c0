"""algo=dpo on the trainers: the weights of train/prepare.dpo_weights (from the policy's and the reference's
logprobs before the step) and DpoLoss take, on either backend, the steps that autograd on DPO's own loss takes in
a plain transformers loop (-log sigmoid(beta (s_chosen - s_rejected)), s = summed policy - reference logprobs of a
response; AdamW at 1e-3): the losses of 8 steps equal to 1e-5, and they fall."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.train.batch import collate
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.train.megatron.backend import MegatronBackend
from slime_hydra.train.objectives import DpoLoss
from slime_hydra.train.prepare import dpo_weights
from tests.train.harness import hf_response_logprobs, run_ranks, tiny_checkpoint

STEPS, BETA = 8, 0.5


def _pairs():
    """6 pairs: one prompt of 3-5 tokens, a chosen and a rejected response of 1-4 tokens each (rows 2i, 2i+1)."""
    g = torch.Generator().manual_seed(0)
    tokens, lengths = [], []
    for _ in range(6):
        prompt = torch.randint(1, 64, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(2):
            n = int(torch.randint(1, 5, (1,), generator=g))
            tokens.append(prompt + torch.randint(1, 64, (n,), generator=g).tolist())
            lengths.append(n)
    return collate(tokens, lengths, [[1] * n for n in lengths], pad_id=0,
                   extras={"rewards": [1.0 - i % 2 for i in range(12)]})


def _plain_dpo(path) -> list[float]:
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf_response_logprobs(net, _pairs()).sum(-1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    batch, losses = _pairs(), []
    for _ in range(STEPS):
        logits = net(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits.float(), -1)
        s = torch.zeros(batch.size)
        for i in range(batch.size):  # position p + j - 1 predicts response token j
            n, p = int(batch.attention_mask[i].sum()), int(batch.response_start[i])
            s[i] = sum(logp[i, p + j - 1, batch.input_ids[i, p + j]] for j in range(n - p))
        s = s - ref
        loss = -torch.nn.functional.logsigmoid(BETA * (s[0::2] - s[1::2])).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _trainer_dpo(rank, world, path, kind) -> list[float]:
    train = TrainConfig(dtype="fp32", lr=1e-3, adam_beta2=0.999, clip_grad=0.0, micro_batch_samples=4,
                        num_gpus=world)
    Backend = MegatronBackend if kind == "megatron" else FSDPBackend
    backend = Backend(path, train, total_steps=STEPS, loss_agg="seq_mean_token_sum", keep_reference=True,
                      device="cpu")
    algo = AlgoConfig(name="dpo", objective="dpo", loss_agg="seq_mean_token_sum")
    algo.dpo.beta = BETA
    losses = []
    for _ in range(STEPS):
        batch = _pairs()
        rows = list(range(batch.size))  # every rank computes the weights of the whole batch, trains its share
        metrics = dpo_weights(batch, BETA, backend.logprobs(batch, "current")[0], backend.logprobs(batch, "ref")[0])
        share = batch.select(rows[rank::world])
        backend.train_step(share, DpoLoss(algo, max_response_tokens=8))
        losses.append(metrics["train/dpo_loss"])
    return losses


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint()


@pytest.mark.parametrize("kind,world", [("fsdp", 1), ("megatron", 1), ("fsdp", 2)], ids=["fsdp", "megatron", "fsdp-dp2"])
def test_dpo_on_the_trainer_takes_the_steps_of_dpos_own_loss(path, kind, world):
    """dp2 splits the pairs' rows over two ranks (rows 0, 2, 4, ...: every chosen response on rank 0, every rejected
    one on rank 1): the precomputed weights make each row's gradient its own, so the split does not matter."""
    want = _plain_dpo(path)
    got = run_ranks(world, _trainer_dpo, str(path), kind)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[0] == pytest.approx(0.6931, abs=1e-4) and got[-1] < 0.5 * got[0]  # log 2 at the reference
