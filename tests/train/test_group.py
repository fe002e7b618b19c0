"""The train group on real Ray: two rank actors form one gloo group and match a single-process run."""

import os

import pytest
import ray
from ray.util.placement_group import placement_group

from slime_hydra.train.config import TrainConfig
from slime_hydra.train.group import TrainGroup
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch
from tests.train.test_fsdp import CFG, _three_steps


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_rank_group_trains_like_one_process(ray_local):
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
