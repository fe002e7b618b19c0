"""Elastic engines, for real: Ray, sglang-router and embedded CPU engines on the tiny model (engine_pool.py
``add`` / ``remove``). An engine added while the run goes on starts, gets the newest weights (a tensor sync of
other weights, version 1, came before it), registers with the router and takes traffic. An engine removed while a
batch generates on it is drained: its requests finish there, the batch comes back whole (every prompt once, every
sample index once), nothing is retried, its server stops and the next batch runs on the other engine alone."""

import asyncio

import pytest
import ray

from slime_hydra.model.warm_start import resolve_model_path
from slime_hydra.rollout.auth import read_api_key
from slime_hydra.rollout.engines.embedded.server import read_checkpoint
from tests.rollout.helpers import engine_info, manager_config, start_manager, wait_running

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_driver")]  # the shared Ray node


def _whole(samples: list[dict]) -> None:
    """8 prompts x 4 samples, every index once, every prompt once, all with the weights of version 1."""
    assert len(samples) == 32 and len({s["index"] for s in samples}) == 32
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s["group_index"], []).append(s)
    assert sorted(len(g) for g in groups.values()) == [4] * 8
    assert len({str(g[0]["prompt"]) for g in groups.values()}) == 8
    assert all(s["status"] in ("completed", "truncated") and s["weight_version"] == 1 for s in samples)


def test_an_added_engine_gets_the_weights_and_traffic_and_a_removed_one_is_drained(tmp_path):
    cfg = manager_config(tmp_path, "rollout.batch_prompts=8", "rollout.n_samples_per_prompt=4",
                         "rollout.max_response_tokens=128", "rollout.health_check_interval_s=0.5")
    manager, engines, urls = start_manager(cfg, tmp_path / "r", num_engines=1)
    key = read_api_key(tmp_path / "r")
    try:
        initial = asyncio.run(engine_info(urls, key))[0]
        other = read_checkpoint(str(resolve_model_path(cfg.model, cfg.data, seed=cfg.seed + 1)))
        ray.get(manager.begin_weight_update.remote())
        ray.get(manager.update_weights_from_tensor.remote(other, 1))
        ray.get(manager.finish_weight_update.remote(1))

        added = ray.get(manager.add_engine.remote(), timeout=180)
        assert (added["index"], added["up"], added["in_router"], added["router_healthy"]) == (1, True, True, True)
        assert ray.get(manager.engine_weight_versions.remote()) == ["1", "1"]
        both = asyncio.run(engine_info([urls[0], added["url"]], key))
        assert both[0]["greedy"] == both[1]["greedy"] != initial["greedy"]  # the synced weights, not the initial
        first = ray.get(manager.generate_batch.remote(), timeout=180)
        _whole(first["samples"])
        after = asyncio.run(engine_info([urls[0], added["url"]], key))
        assert after[1]["tokens"] > both[1]["tokens"]  # the router sent it requests

        future = manager.generate_batch.remote()
        asyncio.run(wait_running(urls[0], key))  # engine 0 holds requests of the batch
        removed = ray.get(manager.remove_engine.remote(0), timeout=120)
        assert (removed["up"], removed["in_router"], removed["cause"], removed["retried"]) == (
            False, False, "removed", 0)  # drained: what it held finished there
        second = ray.get(future, timeout=180)
        _whole(second["samples"])
        assert not {s["index"] for s in second["samples"]} & {s["index"] for s in first["samples"]}
        assert second["metrics"]["rollout/generate_retries"] == 0
        assert second["metrics"]["rollout/engine_restarts"] == 0
        assert not ray.get(engines[0].alive.remote())  # its server stopped

        before = asyncio.run(engine_info([added["url"]], key))[0]
        third = ray.get(manager.generate_batch.remote(), timeout=180)
        _whole(third["samples"])
        assert asyncio.run(engine_info([added["url"]], key))[0]["tokens"] - before["tokens"] >= sum(
            s["response_length"] for s in third["samples"])  # every token of it came from engine 1
        status = ray.get(manager.engine_status.remote())
        assert [(e["up"], e["in_router"]) for e in status] == [(False, False), (True, True)]
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(manager.remove_engine.remote(1), timeout=60)
        assert "engine 1 is the last engine in service" in str(raised.value)
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)
