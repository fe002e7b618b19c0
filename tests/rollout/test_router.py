"""The real sglang-router in front of an embedded engine: started empty, the engine added through /workers,
readiness, /generate through the router identical to the engine's own answers (``lora_path`` passed on), removal,
clean stop."""

import os

import pytest

from slime_hydra.net import free_port
from slime_hydra.rollout.client import EngineError, SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.engines.process import http_status
from slime_hydra.rollout.router import Router, RouterError
from tests.rollout.helpers import build_model, logprobs, tokens

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [60, 61, 62, 63, 1, 2]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_test")
    proc = start_embedded_engine(str(build_model(root / "model", seed=0)), max_batch_size=8,
                                 log_path=root / "engine.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    proc = Router(policy="round_robin", health_check_interval_s=1,
                  log_path=tmp_path_factory.mktemp("router_log") / "router.log").start()
    yield proc
    proc.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); Popen.wait in stop() reaps ours, so only a live process gets here.
    return True


async def test_generate_through_router_matches_engine(engine, router):
    assert router.readiness()["status"] != "ready"  # no workers yet: /health is 200 but readiness is not
    worker_id = router.add_worker(engine.url)
    assert worker_id
    ready = router.wait_ready(min_healthy=1, timeout_s=60)
    assert [w["url"] for w in ready if w["is_healthy"]] == [engine.url]
    assert router.readiness()["healthy_workers"] == 1

    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    sampled = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 11}
    async with SGLangClient(engine.url) as direct, SGLangClient(router.url) as routed:
        for params in (greedy, sampled):
            for prompt in PROMPTS:
                a = await direct.generate(prompt, params, return_logprob=True, rid="same-rid")
                b = await routed.generate(prompt, params, return_logprob=True, rid="same-rid")
                assert tokens(a) == tokens(b) and logprobs(a) == logprobs(b)
                assert b["meta_info"]["id"] == "same-rid" and b["meta_info"]["finish_reason"]["type"] == "length"
        # A batch through the router: one shared sampling_params, no rid list (the router refuses one).
        batch = await routed.generate(PROMPTS, greedy, return_logprob=True)
        assert [tokens(r) for r in batch] == [tokens(await direct.generate(p, greedy)) for p in PROMPTS]
        # The router fans /flush_cache out to its workers; /abort_request it does not route (abort at the engine).
        await routed.flush_cache()
        with pytest.raises(EngineError) as err:
            await routed.abort(abort_all=True)
        assert err.value.status == 404
        # The router passes lora_path on (LoRA adapter sync names the adapter in every /generate): this engine
        # serves none, and says so about the name it was given.
        routed.lora_path = "policy_v3"
        with pytest.raises(EngineError, match=r"LoRA adapter 'policy_v3' is not loaded \(loaded: \[\]\)"):
            await routed.generate(PROMPTS[0], greedy)

    router.remove_worker(engine.url)
    assert router.workers() == []
    assert router.readiness()["status"] != "ready"
    with pytest.raises(RouterError, match="no worker"):
        router.remove_worker(engine.url)


async def test_a_healthy_router_logs_no_error(engine, tmp_path):
    """Registering an engine and serving through it leaves no ERROR line in router.log (a run's wait for the
    engines once polled /readiness, whose 503 "not ready" answers the router logs as errors)."""
    log = tmp_path / "router.log"
    with Router(health_check_interval_s=1, log_path=log) as fresh:
        fresh.add_worker(engine.url)
        fresh.wait_ready(min_healthy=1, timeout_s=60)
        async with SGLangClient(fresh.url) as routed:
            answer = await routed.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
            assert len(tokens(answer)) == 4
    assert "ERROR" not in log.read_text(), log.read_text()


def test_stop_leaves_no_process(engine, tmp_path):
    extra = Router(log_path=tmp_path / "router.log").start()
    pid = extra.process.pid
    assert pid_alive(pid)
    assert extra.stop() is not None
    assert not pid_alive(pid) and not extra.process.alive
    assert "0.0.0.0" not in " ".join(extra.process.argv)


def test_router_refuses_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        Router(policy="fastest")


def test_a_picked_port_taken_before_the_router_binds_it_is_picked_again(tmp_path, monkeypatch):
    """The race behind a CI failure: the OS hands out a free port, another process takes it, then the router exits
    with "Address already in use". Here the first pick is a port held open on purpose."""
    import socket

    import slime_hydra.rollout.router as module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    monkeypatch.setattr(module, "free_port", lambda host: next(picks, None) or free_port(host))
    router = Router(log_path=tmp_path / "router.log")
    try:
        assert router.port == taken.getsockname()[1]
        router.start()
        assert router.port != taken.getsockname()[1] and http_status(f"{router.url}/health") == 200
        assert "Address already in use" in (tmp_path / "router.log").read_text()
    finally:
        router.stop()
        taken.close()
