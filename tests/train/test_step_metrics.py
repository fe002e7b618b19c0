"""StepMetrics: a step's loss metrics are weighted means over the global batch and ``*_max`` metrics maxima, the
same on every data-parallel rank; and a backend reports the train-vs-rollout mismatch from its training forward."""

import torch

from slime_hydra.train.backend import StepMetrics
from tests.train.harness import run_ranks, tiny_checkpoint, toy_batch


def _accumulate(rank: int, world: int):
    metrics = StepMetrics()
    # rank r holds two micro-batches; weights over both ranks sum to 1
    for k, weight in enumerate((0.1, 0.15) if rank == 0 else (0.25, 0.5)):
        metrics.add({"loss": torch.tensor(float(10 * rank + k)), "gap_max": torch.tensor(float(3 * rank - k))},
                    weight)
    return StepMetrics.reduce(metrics.values(), None, torch.device("cpu"))


def test_means_sum_and_maxima_max_over_ranks():
    rank0, rank1 = run_ranks(2, _accumulate)
    assert rank0 == rank1
    assert abs(rank0["loss"] - (0 * 0.1 + 1 * 0.15 + 10 * 0.25 + 11 * 0.5)) < 1e-6  # fp32 products, fp64 sum
    assert rank0["gap_max"] == 3.0


def _train_with_rollout_logprobs(rank: int, world: int, path: str):
    from slime_hydra.algo.config import AlgoConfig
    from slime_hydra.train.config import TrainConfig
    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.objectives import ActorLoss

    backend = FSDPBackend(path, TrainConfig(dtype="fp32", micro_batch_samples=2, lr=1e-4), total_steps=1)
    batch = toy_batch()
    logp, _ = backend.logprobs(batch)
    shifted = logp - 0.25 * batch.loss_mask  # an "engine" whose logprobs are 0.25 lower on every trained token
    shifted[1, 0] -= 0.5                      # and 0.75 lower on one
    batch.extras["rollout_logprobs"] = shifted
    return backend.train_step(batch.select(list(range(rank, batch.size, world))), ActorLoss(AlgoConfig(), 8))


def test_backend_reports_the_mismatch_from_its_training_forward():
    path = str(tiny_checkpoint())
    for world in (1, 2):
        metrics = run_ranks(world, _train_with_rollout_logprobs, path)[0]
        assert abs(metrics["train_rollout_logprob_abs_diff_max"] - 0.75) < 1e-5
        assert 0.25 < metrics["train_rollout_logprob_abs_diff"] < 0.3
