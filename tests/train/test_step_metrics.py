"""StepMetrics: a step's loss metrics are weighted means over the global batch and ``*_max`` metrics maxima, the
same on every data-parallel rank."""

import torch

from slime_hydra.train.backend import StepMetrics
from tests.train.harness import run_ranks


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

