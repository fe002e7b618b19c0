"""Fault tolerance of the rollout manager, for real: Ray, sglang-router, embedded CPU engines on the tiny model.

Most tests share one manager with two engines (``pair``), and each pushes weights the engines do not hold yet
through the trainer's own sender (``WeightPusher``, this process as rank 0 of a one-rank gloo world), so a restart
that kept older weights shows in the greedy tokens:
- an engine process is killed with SIGKILL while a batch is generating: the batch still comes back whole (every
  prompt once, every sample index once), and the engine is restarted on its address with the newest weights,
  registered in the router again, and serves the next batch;
- an engine killed between two broadcast syncs (weight_sync=distributed): the broadcast group is formed again with
  every engine;
- an engine killed in the middle of a sync, by each CPU method;
- last, an engine's Ray actor killed: the health checks and the next batch stop, naming it.
Tests with a manager of their own: with one engine, a failed request is retried once the engine is back, and when
the restart fails the error names the engine and why; an engine killed after a LoRA adapter sync by disk, whose
restart loads the named adapter again.
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import ray

from slime_hydra.model.warm_start import resolve_model_path
from slime_hydra.rollout.auth import read_api_key
from slime_hydra.rollout.engines.embedded.server import read_checkpoint
from tests.rollout.helpers import engine_info, manager_config, start_manager, wait_running

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_driver")]  # the shared Ray node
SHAPE = ("rollout.batch_prompts=8", "rollout.n_samples_per_prompt=4", "rollout.max_response_tokens=128",
         "rollout.health_check_interval_s=0.5")


def _running(pid: int) -> bool:
    """Whether process pid exists and has not exited (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _close_every_connection(sock: socket.socket) -> None:
    """Accept and close at once, until the socket is closed (a readiness probe fails fast instead of hanging)."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def test_generate_retries_after_a_restart_then_fails_naming_the_engine(tmp_path):
    """One engine, no periodic checks, one retry. Killed, the engine fails the request; the check that runs on the
    failure restarts it and the retry succeeds. Killed again, found by a check, and its port taken before the new
    server binds it: the restart fails, the retry fails too, and the error names the engine, its address and both
    causes."""
    cfg = manager_config(tmp_path, "rollout.batch_prompts=2", "rollout.n_samples_per_prompt=2",
                         "rollout.max_generate_retries=1", "rollout.health_check_interval_s=0")
    manager, engines, urls = start_manager(cfg, tmp_path / "r", num_engines=1)
    try:
        server = psutil.Process(ray.get(engines[0].pid.remote()))
        # Ray runs its workers at nice 15 unless told otherwise (cluster/local_ray.NORMAL_PRIORITY_ENV): the engine's
        # actor, and the server it started, run at normal priority
        assert server.nice() == server.parent().nice() == 0
        os.kill(server.pid, signal.SIGKILL)
        batch = ray.get(manager.generate_batch.remote(), timeout=180)
        assert len(batch["samples"]) == 4 and len({s["index"] for s in batch["samples"]}) == 4
        assert batch["metrics"]["rollout/engine_restarts"] == 1
        assert batch["metrics"]["rollout/generate_retries"] >= 1
        assert [e["up"] and e["in_router"] for e in ray.get(manager.engine_status.remote())] == [True]

        pid = ray.get(engines[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        while ray.get(engines[0].alive.remote()):  # SIGKILL lands within milliseconds
            time.sleep(0.01)
        assert ray.get(engines[0].describe.remote()).startswith(f"pid {pid} exited with code -9; its log ends: ")
        port = int(urls[0].rsplit(":", 1)[1])
        with socket.socket() as squatter:
            assert ray.get(manager.check_engines.remote()) == [0]  # out of the router; the restart is loading
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()  # the restarted server cannot bind its port
            threading.Thread(target=_close_every_connection, args=(squatter,), daemon=True).start()
            with pytest.raises(ray.exceptions.RayTaskError) as raised:
                ray.get(manager.generate_batch.remote(), timeout=180)
        message = str(raised.value)
        assert "EngineFailure" in message and "rollout.max_generate_retries=1" in message
        assert f"engine 0 ({urls[0]}): its process (pid {pid}) exited; the restart failed" in message
        assert "first error: " in message and "last error: " in message
        # the engine's own words: the restarted server could not bind its port
        tail = message.split("engine_0.log, its last traceback:\n", 1)[1]
        assert tail.startswith("  File ") and f"address ('127.0.0.1', {port}): address already in use" in tail
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)


def test_a_restarted_engine_loads_the_named_adapter_again(tmp_path):
    """A LoRA adapter synced by disk (SGLang's /load_lora_adapter) is replayed into a restarted engine: it is back in
    the router with the adapter under the same name and the sync's version, generating what the other engine does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = manager_config(tmp_path, "rollout.batch_prompts=2", "rollout.n_samples_per_prompt=2",
                         "rollout.health_check_interval_s=0.5")
    base = resolve_model_path(cfg.model, cfg.data, seed=cfg.seed)
    torch.manual_seed(3)  # init_lora_weights=False: B random too, so the adapter changes the greedy tokens
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                             LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    manager, engines, urls = start_manager(cfg, tmp_path / "r", lora=config)
    key = read_api_key(tmp_path / "r")
    try:
        initial = asyncio.run(engine_info(urls, key))
        ray.get(manager.begin_weight_update.remote())
        ray.get(manager.load_adapter_from_disk.remote(str(tmp_path / "adapter"), 1))
        ray.get(manager.finish_weight_update.remote(1))
        synced = asyncio.run(engine_info(urls, key, lora_path="policy_v1"))
        assert synced[0]["greedy"] == synced[1]["greedy"] != initial[0]["greedy"]

        old_pid = ray.get(engines[1].pid.remote())
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while ray.get(engines[1].pid.remote()) == old_pid or not all(
                e["up"] and e["in_router"] for e in ray.get(manager.engine_status.remote())):
            assert time.monotonic() < deadline, ray.get(manager.engine_status.remote())
            time.sleep(0.2)
        assert ray.get(manager.engine_weight_versions.remote()) == ["1", "1"]
        back = asyncio.run(engine_info(urls, key, lora_path="policy_v1"))
        assert back[1]["greedy"] == back[0]["greedy"] == synced[0]["greedy"]  # the adapter, loaded again
        samples = ray.get(manager.generate_batch.remote(), timeout=180)["samples"]
        assert len(samples) == 4 and all(s["weight_version"] == 1 for s in samples)
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)


class _WeightsOf:
    """The trainer backend's part in a sync (``WeightPusher`` asks it for its full weights or an HF export),
    reduced to the tensors of a model directory; ``during_sync`` runs once the sync is under way (between two
    buckets, or after the export), so an engine can be killed at that point of the sync and at no other."""

    def __init__(self, model_dir: str, during_sync=None):
        self.model_dir, self.during_sync = model_dir, during_sync

    def _midway(self) -> None:
        if self.during_sync is not None:
            self.during_sync()
            self.during_sync = None

    def iter_full_weights(self):
        weights = read_checkpoint(self.model_dir)
        for k, name in enumerate(sorted(weights)):
            if k == len(weights) // 2:
                self._midway()
            yield name, weights[name]

    def export_hf(self, out: Path) -> None:
        shutil.copytree(self.model_dir, out, dirs_exist_ok=True)
        self._midway()


@dataclass
class Pair:
    """Two engines behind one rollout manager (8 prompts x 4 samples a batch, health checks every 0.5 s), shared by
    the tests that leave both engines up and in the router, and the trainer's side of a sync: this process as rank 0
    of a one-rank gloo world, one ``WeightPusher`` per method. Each sync sends the next version of weights the
    engines do not hold: the tiny model's checkpoints of three seeds, in turn."""
    manager: object
    engines: list
    urls: list[str]
    key: str
    run_dir: Path
    models: list[str]
    holding: int = 0
    """Index in ``models`` of the weights the engines hold."""
    version: int = 0
    pushers: dict = field(default_factory=dict)

    def push(self, method: str, during_sync=None) -> dict:
        """Sync the next checkpoint as the next version by ``method`` (``during_sync`` runs half-way); returns the
        push's metrics."""
        from slime_hydra.train.weight_sync import WeightPusher

        if method not in self.pushers:  # one per method: a broadcast pusher keeps its group between syncs
            self.pushers[method] = WeightPusher(None, method, self.manager, bucket_mb=1,
                                                run_dir=str(self.run_dir), dtype="float32")
        pusher = self.pushers[method]
        nxt = (self.holding + 1) % len(self.models)
        pusher.backend = _WeightsOf(self.models[nxt], during_sync)
        metrics = pusher.push(self.version + 1)
        self.holding, self.version = nxt, self.version + 1
        return metrics

    def info(self, urls=None) -> list[dict]:
        return asyncio.run(engine_info(self.urls if urls is None else urls, self.key))

    def both_up(self) -> None:
        """Both engines in service and in the router, holding the last version."""
        status = ray.get(self.manager.engine_status.remote())
        assert [(e["up"], e["in_router"]) for e in status] == [(True, True)] * 2, str(status)
        assert ray.get(self.manager.engine_weight_versions.remote()) == [str(self.version)] * 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("pair")
    cfg = manager_config(tmp, *SHAPE)
    manager, engines, urls = start_manager(cfg, tmp / "r")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield Pair(manager, engines, urls, read_api_key(tmp / "r"), tmp / "r",
                   [str(resolve_model_path(cfg.model, cfg.data, seed=cfg.seed + k)) for k in range(3)])
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)
        dist.destroy_process_group()


def test_engine_killed_mid_rollout_is_restarted_and_loses_nothing(pair):
    manager, engines = pair.manager, pair.engines
    initial = pair.info()
    pair.push("tensor")
    synced = pair.info()
    assert synced[0]["greedy"] == synced[1]["greedy"] != initial[0]["greedy"]  # new weights, both engines

    old_pid = ray.get(engines[1].pid.remote())
    future = manager.generate_batch.remote()
    asyncio.run(wait_running(pair.urls[1], pair.key))
    os.kill(old_pid, signal.SIGKILL)
    started = time.monotonic()
    first = ray.get(future, timeout=180)
    samples = first["samples"]

    # the batch is whole: 8 prompts x 4 samples, every index once, every prompt once
    assert len(samples) == 32
    assert len({s["index"] for s in samples}) == 32
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s["group_index"], []).append(s)
    assert sorted(len(g) for g in groups.values()) == [4] * 8
    assert len({str(g[0]["prompt"]) for g in groups.values()}) == 8
    assert all(len({str(s["prompt"]) for s in g}) == 1 for g in groups.values())
    assert all(s["status"] in ("completed", "truncated") for s in samples)
    assert all(s["weight_version"] == pair.version for s in samples)
    assert all(len(s["rollout_log_probs"]) == s["response_length"] > 0 for s in samples)

    # the engine is back: new process, in the router and healthy there, same weights as the other
    ray.get(manager.wait_engines_settled.remote(), timeout=180)
    recovered_s = time.monotonic() - started
    status = ray.get(manager.engine_status.remote())
    assert [(e["up"], e["in_router"], e["router_healthy"]) for e in status] == [(True, True, True)] * 2
    assert ray.get(engines[1].alive.remote()) and ray.get(engines[1].pid.remote()) != old_pid
    pair.both_up()
    back = pair.info()
    assert back[1]["greedy"] == back[0]["greedy"] == synced[0]["greedy"]  # the replayed weights, not initial

    # the next batch uses both engines and new prompts
    second = ray.get(manager.generate_batch.remote(), timeout=180)
    after = pair.info()
    assert after[0]["tokens"] > back[0]["tokens"] and after[1]["tokens"] > back[1]["tokens"]
    assert len(second["samples"]) == 32
    assert not {s["index"] for s in second["samples"]} & {s["index"] for s in samples}
    restarts = first["metrics"]["rollout/engine_restarts"] + second["metrics"]["rollout/engine_restarts"]
    assert restarts == 1
    print(f"recovered in {recovered_s:.1f} s; retries {first['metrics']['rollout/generate_retries']:.0f}")


def test_broadcast_group_is_formed_again_after_a_restart(pair):
    """weight_sync=distributed cannot replay a broadcast into a restarted engine: it waits out of the router for the
    next sync, the group is marked stale, the survivor leaves the old group, and the next sync's new group (all
    engines again) brings both engines to the same new weights."""
    manager, engines = pair.manager, pair.engines
    initial = pair.info()
    assert pair.push("distributed")["sync/attempts"] == 1
    synced = pair.info()
    assert synced[0]["greedy"] == synced[1]["greedy"] != initial[0]["greedy"]
    assert not ray.get(manager.weight_group_stale.remote())

    os.kill(ray.get(engines[1].pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 120
    # restarted on the initial weights, out of service until a sync reaches it
    while "waits for the next weight sync" not in (ray.get(manager.engine_status.remote())[1]["cause"] or ""):
        assert time.monotonic() < deadline, ray.get(manager.engine_status.remote())
        time.sleep(0.2)
    status = ray.get(manager.engine_status.remote())
    assert [(e["up"], e["in_router"]) for e in status] == [(True, True), (False, False)]
    assert ray.get(manager.weight_group_stale.remote())  # the group lost a member

    assert pair.push("distributed")["sync/attempts"] == 1  # a new group: weights neither engine has had
    pair.both_up()
    assert not ray.get(manager.weight_group_stale.remote())
    back = pair.info()
    assert back[0]["greedy"] == back[1]["greedy"] not in (initial[0]["greedy"], synced[0]["greedy"])
    assert len(ray.get(manager.generate_batch.remote(), timeout=180)["samples"]) == 32


@pytest.mark.parametrize("method", ["distributed", "tensor", "disk"])
def test_an_engine_killed_during_a_sync_costs_the_sync_nothing(pair, method):
    """An engine SIGKILLed in the middle of a weight sync, by each CPU method, through the trainer's real
    ``WeightPusher`` and the rollout manager: the push returns; the other engine holds the new version; the dead one
    is restarted. By tensor or disk the sync goes on without it and it is given the new weights when it is back (one
    attempt); a broadcast fails for every member when one dies, so the trainer sends the version once more to the
    survivor (two attempts). The next sync reaches both engines."""
    from slime_hydra.train.weight_sync import ENGINES_SETTLE_S

    manager, engines = pair.manager, pair.engines
    old_pid = ray.get(engines[1].pid.remote())

    def kill_engine_1():
        """SIGKILL, then wait until the process is gone: by its pid, not by the engine actor's ``alive``, which
        reports the restarted server once the health checks found the death and restarted it (under load, all of
        that can happen between two polls)."""
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _running(old_pid):
            assert time.monotonic() < deadline, "engine 1 still running 30 s after SIGKILL"
            time.sleep(0.05)

    initial = pair.info()
    started = time.monotonic()
    assert pair.push(method, during_sync=kill_engine_1)["sync/attempts"] == (2 if method == "distributed" else 1)
    # a failed broadcast ends the survivor's receive at once, not after the sender's wait for it
    assert time.monotonic() - started < ENGINES_SETTLE_S / 2
    synced = pair.info(pair.urls[:1])[0]
    assert synced["version"] == str(pair.version) and synced["greedy"] != initial[0]["greedy"]

    ray.get(manager.wait_engines_settled.remote(), timeout=180)
    assert ray.get(engines[1].pid.remote()) != old_pid  # restarted
    status = ray.get(manager.engine_status.remote())[1]
    if method == "distributed" and not status["up"]:  # back after the second attempt began: a broadcast
        assert not status["in_router"] and "waits for the next weight sync" in status["cause"], str(status)
    else:  # replayed from the manager's copy, reloaded from the export, or back in time for the second attempt
        pair.both_up()
        assert pair.info(pair.urls[1:])[0]["greedy"] == synced["greedy"]

    assert pair.push(method)["sync/attempts"] == 1
    pair.both_up()
    back = pair.info()
    assert back[0]["greedy"] == back[1]["greedy"] not in (initial[0]["greedy"], synced["greedy"])


def test_an_engine_actor_that_dies_stops_the_health_checks_loudly_and_the_next_batch(pair):
    """The engine's Ray actor itself killed (Ray does not restart it): the periodic check fails, says so, and the
    next batch raises the actor's death instead of generating without the engine. The pair's last test: its
    manager cannot generate again."""
    ray.kill(pair.engines[1], no_restart=True)
    deadline = time.monotonic() + 60
    while "the health checks stopped" not in (report := ray.get(pair.manager.stall_probe.remote())[1]):
        assert time.monotonic() < deadline, report
        time.sleep(0.1)
    assert "ActorDiedError" in report
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(pair.manager.generate_batch.remote(), timeout=60)
    assert "ActorDiedError" in str(raised.value) and "EngineActor" in str(raised.value)
