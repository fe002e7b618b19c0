"""The train group on real Ray: two rank actors form one gloo group and match a single-process run; how the batch's
rows are shared over data-parallel ranks."""

import ray
import torch
from hypothesis import given, settings, strategies as st
from ray.util.placement_group import placement_group

from slime_hydra.train.batch import collate, dp_shares
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.group import TrainGroup
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch
from tests.train.test_fsdp import CFG, _three_steps


def test_two_rank_group_trains_like_one_process(ray_driver):
    path = tiny_checkpoint()
    expected = run_ranks(1, _three_steps, path, 8, None)[0]
    pg = placement_group([{"CPU": 1}] * 2)
    ray.get(pg.ready(), timeout=60)
    group = TrainGroup(pg, 2, "fsdp", path, TrainConfig(**CFG, micro_batch_samples=2), total_steps=3,
                       loss_agg="token_mean", keep_reference=True)
    batch = toy_batch()
    logp0, _ = group.logprobs(batch)
    ref0, _ = group.logprobs(batch, policy="ref")
    assert (logp0 - ref0).abs().max() == 0
    got = [group.train_step(batch, pg_loss) for _ in range(3)]
    for metrics, (loss, norm) in zip(got, expected):
        assert abs(float(metrics["pg_loss"]) - loss) < 1e-5 and abs(metrics["grad_norm"] - norm) < 1e-5
    logp3, _ = group.logprobs(batch)
    assert (logp3 - logp0).abs().max() > 1e-3
    group.shutdown()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 8))
def test_dp_shares_split_every_row_once_in_equal_counts(lengths, dp):
    batch = collate([[1] * n for n in lengths], [1] * len(lengths), [[1]] * len(lengths), pad_id=0)
    shares = dp_shares(batch, dp)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert dp_shares(batch, dp) == shares  # every rank computes the same split


def test_dp_shares_balance_tokens_where_round_robin_does_not():
    """256 rows of 32..1,024 response tokens (a realistic RL spread, seeded) over 4 ranks: the busiest rank's
    tokens are within 0.1% of the mean (round-robin dealing: several percent over)."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(32, 1025, (256,), generator=g) + 64).tolist()
    batch = collate([[1] * n for n in lengths], [n - 64 for n in lengths], [[1] * (n - 64) for n in lengths],
                    pad_id=0)
    mean = sum(lengths) / 4
    balanced = max(sum(lengths[i] for i in share) for share in dp_shares(batch, 4)) / mean
    dealt = max(sum(lengths[r::4]) for r in range(4)) / mean
    assert balanced < 1.001 < 1.02 < dealt, (balanced, dealt)
