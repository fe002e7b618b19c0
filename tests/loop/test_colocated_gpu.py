"""Colocated on one GPU (python3 -m pytest -m gpu tests/loop/test_colocated_gpu.py), with memory moves
(cluster.colocate_offload=always) and without (never: both resident): after every path that touches the
parameters (the trainer's offload / onload, the engine's release / resume of its weights, a training step and the
CUDA IPC weight sync), the engine scores a fixed sequence as the trainer does (``sync_k``: engine prefill
against the trainer's logprobs pass), and the logprobs the engine sampled with match the trainer's training
forward (``rollout_k``: the loop's train/train_rollout_* metric). The model is the tiny default briefly
warm-started (a random init's near-uniform distributions are not what runs train).

Gates, per token: fp32 mean 1e-5 (the CPU path's); bf16 mean 1e-3, max 0.1 nats. Measured on an H100
(docs/benchmarks.md): with train.compile_eager_numerics (the default) the bf16 gaps are ~6e-5 mean; without it the
compiled trainer computes another function than the eager engine, 1e-2 mean, and fails here. A stale or missing
tensor (a tied embedding the sync skipped, weights lost in a release) moves the logprobs by far more.
"""

import pytest
import ray
import torch

from slime_hydra.config import compose, to_config
from slime_hydra.config.derive import derive
from slime_hydra.loop import Session, init_ray
from slime_hydra.model.warm_start import resolve_model_path
from slime_hydra.rollout.auth import read_api_key
from slime_hydra.tracking.phases import StepTimer
from tests.loop.test_weight_sync import engine_logprobs, trainer_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GATES = {"fp32": (1e-5, 1e-4), "bf16": (1e-3, 1e-1)}
"""dtype -> (mean, max) |engine - trainer| logprob per token."""


def gap(a: list[float], b: list[float]) -> tuple[float, float]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return sum(diffs) / len(diffs), max(diffs)


@pytest.mark.parametrize("dtype, offload", [("fp32", "always"), ("bf16", "always"), ("bf16", "never")])
def test_colocated_paths_keep_engine_and_trainer_equal(tmp_path, dtype, offload):
    cfg = to_config(compose([
        "cluster.gpus_per_node=1", "train.num_gpus=1", "cluster.colocate=true", f"cluster.colocate_offload={offload}",
        "rollout.num_gpus=null",
        "train.weight_sync=tensor", f"train.dtype={dtype}", "model.sft_warm_start_steps=100", "rollout.batch_prompts=8",
        "rollout.n_samples_per_prompt=8", "train.micro_batch_samples=64", "train.lr=1e-3", "reward.name=random",
        f"output_dir={tmp_path}", "run_name=r", "rollout.eval_every_steps=0"]))
    mean_gate, max_gate = GATES[dtype]
    assert init_ray(cfg, tmp_path) is None  # joined the shared node (tests/loop/conftest.py)
    session = Session(cfg, derive(cfg), tmp_path / "r", resolve_model_path(cfg.model, cfg.data, cfg.seed))
    try:
        assert session.colocated_moves == (offload == "always")
        url, key = session.engine_urls[0], read_api_key(session.run_dir)
        gaps = {}
        for step in range(2):
            timer = StepTimer()
            session.turns.hand_to("engines", timer)             # trainer offloaded, engine memory resumed
            samples, _ = session.rollout_phase(step, timer)
            session.turns.hand_to("trainer", timer)             # engine memory released, trainer onloaded
            trained_before = trainer_logprobs(session)
            metrics = session.train_phase(samples, timer)      # the training forward vs the sampling engine
            gaps[f"rollout_{step}"] = (metrics["train/train_rollout_logprob_abs_diff"],
                                       metrics["train/train_rollout_logprob_abs_diff_max"])
            trained = trainer_logprobs(session)
            assert gap(trained_before, trained)[1] > 1e-4      # the step moved the policy
            session.turns.hand_to("both", timer)                # engine weights resumed for the sync
            session.trainer.push_weights(step + 1)             # CUDA IPC
            after, version, _ = engine_logprobs(url, key)
            assert version == str(step + 1)
            gaps[f"sync_{step}"] = gap(after, trained)
        print({k: (f"{m:.2e}", f"{x:.2e}") for k, (m, x) in gaps.items()})
        for name, (mean, worst) in gaps.items():
            assert mean < mean_gate and worst < max_gate, f"{name}: mean {mean:.2e} max {worst:.2e} ({dtype})"
    finally:
        session.close()
        ray.shutdown()
