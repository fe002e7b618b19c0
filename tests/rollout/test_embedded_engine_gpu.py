"""The embedded engine on CUDA (run on a GPU machine: python -m pytest -m gpu tests/rollout): greedy tokens and
logprobs against a CPU forward pass, batching, seeded sampling on the device generator, memory release that really
gives GPU memory back and keeps the CUDA graphs, and a gloo broadcast into CUDA buffers (nccl too when a second GPU
is there).

Written without pytest-asyncio (the GPU image lacks it): each test drives its client with asyncio.run."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_hydra.rollout.client import SGLangClient
from slime_hydra.net import free_port
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.engines.embedded.server import read_checkpoint
from slime_hydra.weight_transport import dtype_name, gpu_uuid, share_cuda_bucket
from tests.rollout.helpers import (
    build_models, load, logprobs, mean_abs_diff, reference_greedy, reference_logprobs, tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[7], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [60, 61, 62]]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b, eos = build_models(tmp_path_factory.mktemp("gpu_models"))
    return {"a": a, "b": b, "model_a": load(a), "model_b": load(b)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    proc = start_embedded_engine(str(models["a"]), device="cuda:0", dtype="float32", max_batch_size=4,
                                 log_path=tmp_path_factory.mktemp("gpu_engine") / "engine.log")
    yield proc
    proc.stop()
    assert not proc.alive


def run(coro_fn, url):
    async def main():
        async with SGLangClient(url, timeout_s=120) as client:
            return await coro_fn(client)
    return asyncio.run(main())


def test_greedy_logprobs_and_batching_on_cuda(engine, models):
    async def body(c):
        alone = [await c.generate(p, {**GREEDY, "max_new_tokens": 24}, return_logprob=True) for p in PROMPTS]
        together = await asyncio.gather(*(c.generate(p, {**GREEDY, "max_new_tokens": 24}, return_logprob=True)
                                          for p in PROMPTS + PROMPTS))
        return alone, together, await c.server_info()

    alone, together, info = run(body, engine.url)
    assert info["device"] == "cuda:0" and info["internal_states"][0]["peak_running_reqs"] == 4
    assert info["cuda_graph"] and info["cuda_graph_captures"] >= 2  # buckets 1 (alone) and 4 (together)
    for prompt, resp in zip(PROMPTS, alone):
        assert tokens(resp) == reference_greedy(models["model_a"], prompt, 24)
        ref, _ = reference_logprobs(models["model_a"], prompt, tokens(resp))
        assert mean_abs_diff(logprobs(resp), ref) < 1e-4
    for a, b in zip(alone + alone, together):
        assert tokens(a) == tokens(b) and mean_abs_diff(logprobs(a), logprobs(b)) < 1e-5


def test_seeded_sampling_on_cuda(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 5}

    async def body(c):
        alone = await c.generate(PROMPTS[1], params)
        together = await asyncio.gather(c.generate(PROMPTS[1], params),
                                        *(c.generate(p, {"temperature": 1.0, "max_new_tokens": 20}) for p in PROMPTS))
        return alone, together[0]

    alone, batched = run(body, engine.url)
    assert tokens(alone) == tokens(batched)


def test_release_gives_memory_back_and_keeps_graphs(engine, models):
    prompt, greedy = PROMPTS[2], {**GREEDY, "max_new_tokens": 16}

    async def body(c):
        await c.generate(prompt, greedy)  # the graphs of this prompt's shapes are captured
        before = await c.server_info()
        await c.release_memory_occupation()
        released = await c.server_info()
        await c.update_weights_from_tensor(read_checkpoint(str(models["b"])), weight_version="b")  # into the host copy
        await c.resume_memory_occupation()
        resumed = await c.server_info()
        out_b = await c.generate(prompt, greedy)
        after = await c.server_info()
        await c.update_weights_from_disk(str(models["a"]), weight_version="a")
        return before, released, resumed, after, out_b, await c.generate(prompt, greedy)

    before, released, resumed, after, out_b, out_a = run(body, engine.url)
    weight_bytes = sum(t.numel() * t.element_size() for t in models["model_a"].parameters())
    # Released: the weights' and the KV cache's device memory is given back (the device's free bytes rise by at least
    # the weights), and taken again by the resume; the graphs and the cache's capacity survive: nothing is recaptured.
    assert released["memory_released"] == ["kv_cache", "weights"] and resumed["memory_released"] == []
    assert released["device_free_bytes"] - before["device_free_bytes"] >= weight_bytes
    assert released["device_free_bytes"] - resumed["device_free_bytes"] >= weight_bytes
    assert after["cuda_graph_captures"] == before["cuda_graph_captures"] >= 2
    assert after["kv_capacity_tokens"] == before["kv_capacity_tokens"] > 0
    # The update sent while released landed in the host copy; the resume brought it to the device.
    assert tokens(out_b) == reference_greedy(models["model_b"], prompt, 16)
    assert tokens(out_a) == reference_greedy(models["model_a"], prompt, 16)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_distributed_update_into_cuda(engine, models, backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the sender on a second GPU")
    port = free_port()
    weights = read_checkpoint(str(models["b"]))
    names = sorted(weights)
    group = f"g_{backend}"
    device = "cuda:1" if backend == "nccl" else "cpu"
    sender_code = (f"from tests.rollout.helpers import send_weights; send_weights({port}, {str(models['b'])!r}, "
                   f"backend={backend!r}, device={device!r}, group_name={group!r})")
    sender = subprocess.Popen([sys.executable, "-c", sender_code], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})

    async def body(c):
        await c.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend=backend,
                                          group_name=group)
        await c.update_weights_from_distributed(names, [dtype_name(weights[n].dtype) for n in names],
                                                [list(weights[n].shape) for n in names], group_name=group,
                                                weight_version=f"{backend}-1")
        out = await c.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 16})
        sender.stdin.write("done\n")
        sender.stdin.flush()
        await c.destroy_weights_update_group(group)
        await c.update_weights_from_disk(str(models["a"]), weight_version="0")
        return out

    try:
        out = run(body, engine.url)
        assert out["meta_info"]["weight_version"] == f"{backend}-1"
        assert tokens(out) == reference_greedy(models["model_b"], PROMPTS[2], 16)
        assert sender.wait(timeout=60) == 0, sender.stdout.read()
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()


def test_cuda_ipc_update(engine, models):
    """This process plays the colocated trainer: model b's weights in two buckets on cuda:0, shared by handle."""
    weights = read_checkpoint(str(models["b"]))
    names = sorted(weights)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    shared = [share_cuda_bucket([(n, weights[n].to("cuda:0")) for n in half]) for half in halves]
    entry = shared[0][1]
    assert entry["uuid"] == gpu_uuid(0) and [t[0] for t in entry["tensors"]] == halves[0]
    assert all(t[3] % 256 == 0 for t in entry["tensors"])  # every tensor starts aligned

    async def body(c):
        await c.update_weights_from_cuda_ipc([shared[0][1]])
        await c.update_weights_from_cuda_ipc([{**shared[1][1], "uuid": "GPU-elsewhere"}, shared[1][1]],
                                             weight_version="ipc-1")
        out = await c.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 16}, return_logprob=True)
        try:
            await c.update_weights_from_cuda_ipc([{**shared[1][1], "uuid": "GPU-elsewhere"}])
            refused = ""
        except Exception as error:  # the engine answers success=false naming the GPUs
            refused = str(error)
        await c.update_weights_from_disk(str(models["a"]), weight_version="0")
        return out, refused

    out, refused = run(body, engine.url)
    assert out["meta_info"]["weight_version"] == "ipc-1"
    assert tokens(out) == reference_greedy(models["model_b"], PROMPTS[2], 16)
    assert mean_abs_diff(logprobs(out), reference_logprobs(models["model_b"], PROMPTS[2], tokens(out))[0]) < 1e-4
    assert "no cuda_ipc handle for this engine's GPU" in refused and "GPU-elsewhere" in refused


def _other_thread_works_mid_capture(capture) -> str:
    """Run ``capture(forward)`` (a graph capture of ``forward``) while another thread, at a moment fixed by events
    (inside the captured forward, not a race), allocates fresh memory and synchronizes on a stream of its own, as
    a weight update's receiving thread does; returns that thread's error ("" if none)."""
    import threading

    inside, done, failure = threading.Event(), threading.Event(), []

    def receiver():
        inside.wait()
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                buffer = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")  # 96 MiB: a new cudaMalloc
                buffer.fill_(1)
            stream.synchronize()
        except RuntimeError as error:
            failure.append(str(error))
        done.set()

    weights = torch.randn(64, 64, device="cuda")

    def forward(rows, window):
        if torch.cuda.is_current_stream_capturing():
            inside.set()
            assert done.wait(30)
        return torch.randn(rows, 64, device="cuda").matmul(weights)

    thread = threading.Thread(target=receiver)
    thread.start()
    capture(forward)
    thread.join(30)
    torch.cuda.synchronize()
    return failure[0] if failure else ""


def test_decode_graph_capture_lets_another_thread_use_the_gpu():
    """async mode: the engine captured a new decode graph while the weight update's thread received tensors, and under
    capture's default "global" error mode that thread's CUDA calls failed and killed the engine."""
    from slime_hydra.rollout.engines.embedded.graphs import StepGraphs

    graphs = StepGraphs(lambda rows, window: None, max_rows=8, step="decode")

    def engine_capture(forward):
        graphs.forward = forward
        assert graphs.run(5, 16).shape == (5, 64)
        torch.cuda.synchronize()

    assert _other_thread_works_mid_capture(engine_capture) == ""
    assert graphs.captures == 1 and graphs.failed is None

    def global_capture(forward):  # the mode the engine used before: the same thread's work fails
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="global"):
                forward(8, 16)
        except RuntimeError:
            pass  # the capture itself may be invalidated too

    assert "captur" in _other_thread_works_mid_capture(global_capture).lower()
