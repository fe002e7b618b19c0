"""The run's API key end to end: an embedded engine started by its EngineActor with a key, behind the real
sglang-router started with the same key. Requests without the key, or with a wrong one, get 401 and change nothing;
with it everything works, through the router too; the key is on no process's command line."""

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slime_hydra.rollout.auth import API_KEY_ENV, new_api_key
from slime_hydra.rollout.client import EngineError, SGLangClient
from slime_hydra.rollout.engines.actor import EngineActor
from slime_hydra.rollout.engines.process import http_status
from slime_hydra.rollout.router import Router, RouterError
from tests.rollout.helpers import build_models, tokens

PROMPT = [3, 1, 4, 1, 5]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
CONTROL = [  # every control endpoint, each with a body that would change the engine if it were obeyed
    ("POST", "/update_weights_from_disk", "b"),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "weight_version": "99"}),
    ("POST", "/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]],
                                                  "weight_version": "99"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2}),
    ("POST", "/destroy_weights_update_group", {}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", {}),
    ("GET", "/flush_cache", None),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b, _ = build_models(tmp_path_factory.mktemp("api_key_models"))
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """(key, engine actor, router with the engine registered), both requiring the key."""
    logs = tmp_path_factory.mktemp("api_key_logs")
    key = new_api_key()
    actor = EngineActor(0, str(models["a"]), str(logs), dtype="float32", max_batch_size=4)
    router = Router(health_check_interval_s=1, log_path=logs / "router.log", api_key=key)
    try:
        url = actor.start(key, timeout_s=120)
        router.start()
        router.add_worker(url)
        router.wait_ready(min_healthy=1, timeout_s=60)
        yield key, actor, router
    finally:
        router.stop()
        actor.stop()


def engine_url(actor: EngineActor) -> str:
    return actor.process.url


async def call(url: str, method: str, path: str, body, api_key=None) -> EngineError:
    async with SGLangClient(url, timeout_s=30, api_key=api_key) as c:
        with pytest.raises(EngineError) as err:
            await c.request(method, path, body)
    return err.value


async def test_control_without_the_key_is_refused_and_changes_nothing(served, models):
    key, actor, _ = served
    url = engine_url(actor)
    async with SGLangClient(url, timeout_s=60, api_key=key) as c:
        before = tokens(await c.generate(PROMPT, GREEDY))
        for method, path, body in CONTROL:
            body = {"model_path": str(models["b"]), "weight_version": "99"} if body == "b" else body
            for wrong in (None, "not-the-key", key + "0"):
                err = await call(url, method, path, body, api_key=wrong)
                assert err.status == 401, (path, err)
                given = "no key" if wrong is None else "a wrong key"
                assert f"{method} {path} needs the run's API key and the request carried {given}" in str(err)
                assert f"'Authorization: Bearer <key>' (this engine read its key from {API_KEY_ENV}" in str(err)
        # nothing changed: same version, not paused, memory held, same weights
        assert await c.get_weight_version() == "0"
        assert tokens(await asyncio.wait_for(c.generate(PROMPT, GREEDY), 30)) == before

        # with the key, the same calls work
        await c.update_weights_from_disk(str(models["b"]), weight_version="5")
        assert await c.get_weight_version() == "5"
        assert tokens(await c.generate(PROMPT, GREEDY)) != before
        await c.pause_generation("abort")
        await c.continue_generation()
        await c.update_weights_from_disk(str(models["a"]), weight_version="0")
        assert tokens(await c.generate(PROMPT, GREEDY)) == before


async def test_generate_and_info_need_the_key_health_does_not(served):
    key, actor, _ = served
    url = engine_url(actor)
    for path in ("/generate", "/model_info", "/server_info", "/get_load", "/get_weight_version"):
        method = "POST" if path == "/generate" else "GET"
        body = {"input_ids": PROMPT, "sampling_params": GREEDY} if path == "/generate" else None
        assert (await call(url, method, path, body)).status == 401
    assert http_status(f"{url}/health") == 200 and http_status(f"{url}/health_generate", 70) == 200
    assert actor.healthy()  # the actor's readiness check needs no key


async def test_the_router_requires_the_key_and_forwards_it(served):
    key, actor, router = served
    url = engine_url(actor)
    async with SGLangClient(router.url, api_key=key) as routed, SGLangClient(url, api_key=key) as direct:
        assert tokens(await routed.generate(PROMPT, GREEDY)) == tokens(await direct.generate(PROMPT, GREEDY))
    assert (await call(router.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})).status == 401
    # the router's health checks reach the engine with the key: it stays healthy
    assert [(w["url"], w["is_healthy"]) for w in router.workers()] == [(url, True)]
    assert http_status(f"{router.url}/health") == 200 and http_status(f"{router.url}/readiness") == 200
    keyless = Router(port=router.port, prometheus_port=router.prometheus_port)  # same server, admin call w/o key
    with pytest.raises(RouterError, match="GET /workers -> 401"):
        keyless.workers()


def test_the_key_is_on_no_command_line(served):
    key, actor, router = served
    lines = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                lines[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # it exited meanwhile
                pass
    engine_pid, router_pid = actor.pid(), router.process.pid
    assert "slime_hydra.rollout.engines.embedded" in lines[engine_pid]
    assert lines[router_pid].startswith("sglang::router")  # sglang-router sets its process title
    assert [pid for pid, line in lines.items() if key in line] == []
    for pid in (engine_pid, router_pid):  # it travelled in the environment, which only the owner may read
        environ = Path(f"/proc/{pid}/environ")
        assert f"{API_KEY_ENV}={key}".encode() in environ.read_bytes().split(b"\0")
        assert stat.S_IMODE(environ.stat().st_mode) == 0o400
    assert key not in " ".join(router.process.argv) and router.process.env[API_KEY_ENV] == key


def test_an_engine_without_a_key_refuses_a_routable_host(models):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    out = subprocess.run([sys.executable, "-m", "slime_hydra.rollout.engines.embedded", "--model-path",
                          str(models["a"]), "--host", "0.0.0.0"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().endswith(f"--host 0.0.0.0 is reachable from other machines: set {API_KEY_ENV} to the "
                                       "key every request must carry (or serve on 127.0.0.1)")
