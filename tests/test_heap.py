"""slime_hydra/heap.py: the garbage-collection clock, and the rollout manager's frozen heap (the engine's is checked
in tests/rollout/test_embedded_engine.py). Real Ray, router and one embedded CPU engine for the manager."""

import gc

import pytest
import ray

from slime_hydra.heap import GcTimes
from tests.rollout.helpers import manager_config, start_manager


def test_gc_times_count_collections_while_started():
    """A collection of the oldest generation while started counts once with its seconds; none after stop."""
    times = GcTimes()
    times.start()
    gc.collect()
    times.stop()
    assert times.collections[2] == 1 and times.seconds[2] > 0
    gc.collect()
    assert times.as_dict()["collections"][2] == 1


@pytest.mark.slow
@pytest.mark.usefixtures("ray_driver")  # the shared Ray node
def test_the_rollout_manager_freezes_its_heap_and_reports_its_collections(tmp_path):
    """Once started, the manager's actor process has its long-lived objects (torch, Ray, the tokenizer, the prompt
    set: well over 10,000) frozen, and every batch reports its collections' seconds (perf/rollout_gc_time)."""
    cfg = manager_config(tmp_path, "rollout.batch_prompts=2", "rollout.n_samples_per_prompt=2",
                         "rollout.max_response_tokens=4")
    manager, _, _ = start_manager(cfg, tmp_path / "r", num_engines=1)
    try:
        frozen = ray.get(manager.__ray_call__.remote(lambda self: gc.get_freeze_count()), timeout=60)
        assert frozen > 10_000
        batch = ray.get(manager.generate_batch.remote(), timeout=180)
        assert 0 <= batch["metrics"]["perf/rollout_gc_time"] < 60
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)
