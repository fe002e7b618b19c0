"""Failures that are not the engines': a generate function that raises, a reward past its timeout. Counted in the
batch's metrics with the first error printed; a round in which every group fails stops the rollout with the error;
in an eval the failed samples count as wrong. Real Ray, router and one embedded CPU engine."""

import time

import pytest
import ray

from slime_hydra.rollout.engines.process import last_traceback
from slime_hydra.rollout.generate import default_generate
from tests.rollout.helpers import manager_config, start_manager

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_driver")]  # the shared Ray node
SHAPE = ("rollout.batch_prompts=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_tokens=4")


async def fails_on_group_0(ctx, sample, params):
    if sample.group_index == 0:
        raise ValueError(f"no tool output for sample {sample.index}")
    return await default_generate(ctx, sample, params)


async def always_fails(ctx, sample, params):
    raise RuntimeError("the verifier sandbox is down")


def slow_reward(response, label, metadata):
    time.sleep(2.0)
    return 1.0


def test_failed_samples_drop_their_group_are_counted_and_count_as_wrong_in_an_eval(tmp_path):
    cfg = manager_config(tmp_path, *SHAPE, f"rollout.generate={__name__}.fails_on_group_0",
                         "data.eval=[{name: addition, n_samples_per_prompt: 2, max_prompts: 3}]")
    manager, _, _ = start_manager(cfg, tmp_path / "r", num_engines=1)
    try:
        batch = ray.get(manager.generate_batch.remote(), timeout=180)
        assert len(batch["samples"]) == 4 and {s["group_index"] for s in batch["samples"]} == {1, 2}
        assert batch["metrics"]["rollout/failed_samples"] == 2 and batch["metrics"]["rollout/buffer/failed"] == 1
        assert ray.get(manager.generate_batch.remote(), timeout=180)["metrics"]["rollout/failed_samples"] == 0
        # the eval goes on: the two samples of its prompt 0 count as wrong
        metrics = ray.get(manager.evaluate.remote(), timeout=180)
        assert metrics["eval/addition/failed_samples"] == 2
        assert 0 <= metrics["eval/addition/accuracy"] <= 4 / 6 and metrics["eval/addition/pass@2"] <= 2 / 3
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)


def test_a_round_where_every_group_fails_stops_with_the_error(tmp_path):
    cfg = manager_config(tmp_path, *SHAPE, f"rollout.generate={__name__}.always_fails")
    manager, _, _ = start_manager(cfg, tmp_path / "r", num_engines=1)
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(manager.generate_batch.remote(), timeout=180)
        message = str(raised.value)
        assert "RolloutFailure" in message and "every one of the 2 groups" in message
        assert "RuntimeError: the verifier sandbox is down" in message
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)


def test_reward_timeouts_are_counted(tmp_path):
    cfg = manager_config(tmp_path, *SHAPE, "reward.name=custom", f"reward.target={__name__}.slow_reward",
                         "reward.timeout_s=0.2")
    manager, _, _ = start_manager(cfg, tmp_path / "r", num_engines=1)
    try:
        batch = ray.get(manager.generate_batch.remote(), timeout=180)
        assert batch["metrics"]["rollout/reward_timeouts"] == 4
        assert all(s["reward"] == 0.0 for s in batch["samples"])
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)


def test_last_traceback_is_the_logs_last_one_with_what_follows(tmp_path):
    log = tmp_path / "engine_0.log"
    assert last_traceback(log) == ""                                   # no log yet
    log.write_text("started\nTraceback (most recent call last):\n  old\nValueError: first\nserving\n")
    log.write_text(log.read_text() + "ERROR model step failed\nTraceback (most recent call last):\n  File x\n"
                   "RuntimeError: CUDA error: an illegal memory access\nexiting\n")
    assert last_traceback(log) == "  File x\nRuntimeError: CUDA error: an illegal memory access\nexiting\n"
    assert last_traceback(log, n_chars=8) == "exiting\n"
    log.write_text("no error here\n")
    assert last_traceback(log) == ""
