"""The embedded engine against plain HF forward passes: greedy tokens, logprobs, batching, stops, aborts, pausing,
weight updates (disk, tensor payload, gloo broadcast from a sender process), memory release. One engine serves the
module; tests that change its weights put the first checkpoint back before they end."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_hydra.rollout.client import EngineError, EngineTimeout, EngineUnavailable, SGLangClient
from slime_hydra.net import free_port
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.engines.embedded.server import read_checkpoint
from slime_hydra.weight_transport import dtype_name
from tests.rollout.helpers import (
    EOS_PROMPT, build_models, hf_generate, load, logprobs, mean_abs_diff, reference_greedy, reference_logprobs,
    tokens,
)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[7], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [60, 61, 62], [10, 20, 30, 40, 50, 11, 21]]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_models")
    a, b, eos = build_models(root)
    return {"a": a, "b": b, "eos": eos, "model_a": load(a), "model_b": load(b)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    # max_batch_size 4 < the 8 concurrent requests of the batching tests: requests queue and join mid-flight.
    proc = start_embedded_engine(str(models["a"]), max_batch_size=4,
                                 log_path=tmp_path_factory.mktemp("engine_log") / "engine.log")
    yield proc
    proc.stop()
    assert not proc.alive


async def gen(url, prompt, params, **kwargs):
    async with SGLangClient(url, timeout_s=120) as client:
        return await client.generate(prompt, params, **kwargs)


async def wait_running(client: SGLangClient, min_tokens: int, timeout_s: float = 30.0) -> None:
    """Until the engine's running batch holds at least ``min_tokens`` tokens."""
    for _ in range(int(timeout_s / 0.02)):
        load = (await client.get_load())[0]
        if load["num_tokens"] >= min_tokens:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request reached {min_tokens} tokens; load {load}")


async def test_info_endpoints(engine, models):
    async with SGLangClient(engine.url) as c:
        assert await c.health()
        info = await c.model_info()
        assert info["is_generation"] is True and info["model_path"] == str(models["a"].resolve())
        server = await c.server_info()
        assert server["dp_size"] == 1 and server["max_running_requests"] == 4 and server["skip_tokenizer_init"]
        assert server["batch_invariant"] is False
        assert await c.get_weight_version() == "0"
        assert (await c.get_load())[0]["num_reqs"] == 0
        assert (await c.flush_cache())["success"] is True
        await c.health_generate()
        same = await c.request("GET", "/get_model_info")
        assert same == info


async def test_greedy_matches_hf_generate(engine, models):
    model = models["model_a"]
    for prompt in PROMPTS + [EOS_PROMPT]:
        expected = hf_generate(model, prompt, 24)
        resp = await gen(engine.url, prompt, {"temperature": 0, "max_new_tokens": 24})
        assert tokens(resp) == expected, prompt
        meta = resp["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(expected)
        if expected[-1] == models["eos"]:
            assert meta["finish_reason"] == {"type": "stop", "matched": models["eos"]}
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 24}
    # The checkpoint's EOS id is honoured (EOS_PROMPT's continuation reaches it by construction).
    resp = await gen(engine.url, EOS_PROMPT, {"temperature": 0, "max_new_tokens": 24})
    assert resp["meta_info"]["finish_reason"]["type"] == "stop" and tokens(resp)[-1] == models["eos"]
    # ignore_eos runs past it, token for token like plain argmax decoding.
    resp = await gen(engine.url, EOS_PROMPT, {**GREEDY, "max_new_tokens": 24})
    assert tokens(resp) == reference_greedy(model, EOS_PROMPT, 24)


async def test_logprobs_match_full_forward(engine, models):
    model = models["model_a"]
    prompt = PROMPTS[2]
    resp = await gen(engine.url, prompt, {**GREEDY, "max_new_tokens": 40}, return_logprob=True,
                     logprob_start_len=0, top_logprobs_num=3)
    out_ref, in_ref = reference_logprobs(model, prompt, tokens(resp))
    assert mean_abs_diff(logprobs(resp), out_ref) < 1e-4
    meta = resp["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens(resp)
    assert meta["input_token_logprobs"][0] == [None, prompt[0], None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
    assert mean_abs_diff([lp for lp, _, _ in meta["input_token_logprobs"][1:]], in_ref) < 1e-4
    # Greedy picks the most likely token: the first top logprob is the chosen one.
    for top, chosen in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]):
        assert len(top) == 3 and top[0][1] == chosen[1] and abs(top[0][0] - chosen[0]) < 1e-6
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt)

    # Sampling: logprobs are of logits / temperature, before top-p truncation.
    params = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3}
    resp = await gen(engine.url, prompt, params, return_logprob=True)
    out_ref, _ = reference_logprobs(model, prompt, tokens(resp), temperature=0.7)
    assert mean_abs_diff(logprobs(resp), out_ref) < 1e-4
    assert "input_token_logprobs" in resp["meta_info"] and resp["meta_info"]["input_token_logprobs"] == []

    # logprob_start_len > 0 returns the prompt from there on; max_new_tokens 0 only scores the prompt.
    resp = await gen(engine.url, prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=4)
    assert tokens(resp) == [] and resp["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = resp["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == prompt[4:]
    assert mean_abs_diff([lp for lp, _, _ in scored], in_ref[3:]) < 1e-4


async def test_step_times_count_the_steps_of_a_request(engine):
    """server_info's step_times (what the benchmark splits a round's time by): a request of 10 tokens alone takes
    one prefill (its first token) and 10 decode steps (9 tokens; each step takes in the previous step's token, the last
    one only that), each timed on the model thread within the scheduler's wait. With nothing else to do, the decode
    steps run as one hand-off to the model thread (the last one finishes the request)."""
    async with SGLangClient(engine.url) as c:
        before = (await c.server_info())["internal_states"][0]["step_times"]
        await gen(engine.url, [1, 2, 3], {**GREEDY, "max_new_tokens": 10})
        after = (await c.server_info())["internal_states"][0]["step_times"]
    delta = {kind: {k: v - before[kind][k] for k, v in times.items()} for kind, times in after.items()}
    assert delta["prefill"]["steps"] == 1 and delta["decode"]["steps"] == 10
    assert delta["prefill"]["runs"] == 1 and delta["decode"]["runs"] == 1
    assert delta["prefill"]["model_s"] > 0 and delta["decode"]["model_s"] > 0
    assert all(0 <= t["model_s"] <= t["wait_s"] and t["answer_s"] >= 0 for t in delta.values())


async def test_a_request_joins_a_run_of_decode_steps_at_the_next_step(engine):
    """Decode steps run on the model thread without handing back to the event loop until there is news
    (scheduler._decode_until_news): a request arriving meanwhile is admitted at the next step boundary, not when the
    running request finishes, and both give what they give alone. Ordered by steps, not timed: the short request
    needs 1 prefill and 4 decode steps after it arrives, the long one has ~1,900 left."""
    prompt = PROMPTS[2]
    async with SGLangClient(engine.url) as c:
        solo = tokens(await c.generate(prompt, {**GREEDY, "max_new_tokens": 5}))
        long = asyncio.create_task(c.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 2000}))
        await wait_running(c, len(PROMPTS[1]) + 20)
        short = await c.generate(prompt, {**GREEDY, "max_new_tokens": 5})
        assert not long.done() and tokens(short) == solo
        assert len(tokens(await long)) == 2000


async def test_the_engine_process_freezes_its_heap(engine):
    """The command-line engine owns its process and freezes its heap once loaded (heap.freeze): later collections
    walk only what came after."""
    async with SGLangClient(engine.url) as c:
        states = (await c.server_info())["internal_states"][0]["gc"]
    assert states["frozen_objects"] > 10_000 and len(states["collections"]) == len(states["seconds"]) == 3


async def test_batched_equals_alone(engine):
    prompts = PROMPTS + [[1, 2], [33] * 9, [5, 6, 7, 8]]
    lengths = [30, 12, 25, 7, 40, 3, 18, 22]
    alone = [await gen(engine.url, p, {**GREEDY, "max_new_tokens": n}, return_logprob=True)
             for p, n in zip(prompts, lengths)]
    # 8 concurrent requests on a 4-row engine: the later ones wait, then join as rows finish.
    together = await asyncio.gather(*(gen(engine.url, p, {**GREEDY, "max_new_tokens": n}, return_logprob=True)
                                      for p, n in zip(prompts, lengths)))
    async with SGLangClient(engine.url) as c:
        assert (await c.server_info())["internal_states"][0]["peak_running_reqs"] == 4
    for a, b in zip(alone, together):
        assert tokens(a) == tokens(b)
        assert mean_abs_diff(logprobs(a), logprobs(b)) < 1e-5
    # One batch request (a list of prompts, one sampling_params per prompt) answers a list in order.
    batch = await gen(engine.url, prompts, [{**GREEDY, "max_new_tokens": n} for n in lengths], return_logprob=True)
    assert [tokens(r) for r in batch] == [tokens(r) for r in alone]

    # A request that joins a batch already decoding (step boundary) still matches its solo run.
    async with SGLangClient(engine.url) as c:
        long = asyncio.create_task(c.generate(PROMPTS[4], {**GREEDY, "max_new_tokens": 300}))
        await wait_running(c, len(PROMPTS[4]) + 20)
        late = await asyncio.gather(*(c.generate(p, {**GREEDY, "max_new_tokens": n}) for p, n in
                                      zip(prompts[:3], lengths[:3])))
        long_alone_tokens = tokens(await long)
    assert [tokens(r) for r in late] == [tokens(r) for r in alone[:3]]
    assert long_alone_tokens[:40] == tokens(alone[4])


async def test_seeded_sampling_is_reproducible_in_any_batch(engine, models):
    params = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 1234}
    alone = await gen(engine.url, PROMPTS[1], params)
    others = [gen(engine.url, p, {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True}) for p in PROMPTS]
    together = await asyncio.gather(gen(engine.url, PROMPTS[1], params), *others)
    assert tokens(together[0]) == tokens(alone)
    other_seed = await gen(engine.url, PROMPTS[1], {**params, "sampling_seed": 99})
    assert tokens(other_seed) != tokens(alone)
    # top_k=1 keeps only the argmax: sampling then equals greedy decoding.
    top1 = await gen(engine.url, PROMPTS[2], {"temperature": 1.0, "top_k": 1, "max_new_tokens": 15,
                                             "ignore_eos": True})
    assert tokens(top1) == reference_greedy(models["model_a"], PROMPTS[2], 15)


async def test_stop_conditions(engine, models):
    prompt = PROMPTS[3]
    full = tokens(await gen(engine.url, prompt, {**GREEDY, "max_new_tokens": 30}))
    resp = await gen(engine.url, prompt, {**GREEDY, "max_new_tokens": 5})
    assert tokens(resp) == full[:5] and resp["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    stop_id = full[6]
    k = full.index(stop_id)
    resp = await gen(engine.url, prompt, {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [stop_id]},
                     return_logprob=True)
    assert tokens(resp) == full[:k + 1]  # the matched token is part of the output, with its logprob
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(resp["meta_info"]["output_token_logprobs"]) == k + 1
    # max_new_tokens is checked first (SGLang's order): a stop token in the last slot still reads as length.
    resp = await gen(engine.url, prompt, {"temperature": 0, "max_new_tokens": k + 1, "stop_token_ids": [stop_id]})
    assert resp["meta_info"]["finish_reason"] == {"type": "length", "length": k + 1}


async def test_bad_requests_answer_400(engine):
    cases = [
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "unknown sampling_params"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "does not implement"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "need a tokenizer"),
        ({"text": "hello"}, "need a tokenizer"),
        ({"input_ids": [1, 999]}, "outside the vocabulary"),
        ({"input_ids": [[1], [2]], "rid": "same"}, "one id per prompt"),
        ({"input_ids": [[1], [2]], "rid": ["r", "r"]}, "repeat"),
        ({"input_ids": [1], "stream": True}, "does not support"),
        ({"input_ids": [1], "surprise": 1}, "unknown /generate fields"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "below the prompt length"),
    ]
    async with SGLangClient(engine.url) as c:
        for body, message in cases:
            with pytest.raises(EngineError) as err:
                await c.request("POST", "/generate", body)
            assert err.value.status == 400 and message in str(err.value), (body, str(err.value))
        assert (await c.get_load())[0]["num_reqs"] == 0


async def test_abort_returns_partial_tokens(engine):
    async with SGLangClient(engine.url) as c:
        task = asyncio.create_task(c.generate([1, 2, 3], {**GREEDY, "max_new_tokens": 3000}, return_logprob=True,
                                              rid="long-one"))
        await wait_running(c, 3 + 10)
        assert (await c.abort("long-one"))["num_aborted"] == 1
        resp = await task
        meta = resp["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "long-one"
        assert 10 <= meta["completion_tokens"] < 3000
        assert len(tokens(resp)) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
        # The partial tokens are the same as an uninterrupted run's prefix.
        solo = await c.generate([1, 2, 3], {**GREEDY, "max_new_tokens": meta["completion_tokens"]})
        assert tokens(solo) == tokens(resp)

        # abort_all ends every request, running or queued (6 requests on 4 rows).
        tasks = [asyncio.create_task(c.generate([i + 1], {**GREEDY, "max_new_tokens": 3000})) for i in range(6)]
        await wait_running(c, 4 * 10)
        await c.abort(abort_all=True)
        done = await asyncio.gather(*tasks)
        assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in done)
        assert sum(r["meta_info"]["completion_tokens"] == 0 for r in done) >= 2  # the queued ones never started
        assert (await c.get_load())[0]["num_reqs"] == 0


async def test_client_errors(engine):
    async with SGLangClient(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2) as dead:
        with pytest.raises(EngineUnavailable):
            await dead.generate([1], {"max_new_tokens": 1})
        assert not await dead.health()
    async with SGLangClient(engine.url) as c:
        with pytest.raises(EngineTimeout):
            await c.generate([1, 2], {**GREEDY, "max_new_tokens": 3000}, timeout_s=0.3)
        # The engine noticed the disconnect and dropped the request.
        for _ in range(200):
            if (await c.get_load())[0]["num_reqs"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await c.get_load())[0]["num_reqs"] == 0
        with pytest.raises(ValueError):
            await c.abort()


async def test_pause_modes(engine):
    prompt, n = PROMPTS[2], 200
    async with SGLangClient(engine.url) as c:
        solo = await c.generate(prompt, {**GREEDY, "max_new_tokens": n}, return_logprob=True)

        # in_place: the request is held, then finishes exactly as if never paused.
        await c.pause_generation("in_place")
        held = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": n}, return_logprob=True))
        await asyncio.sleep(0.3)
        assert not held.done()
        await c.continue_generation()
        resp = await held
        assert tokens(resp) == tokens(solo) and mean_abs_diff(logprobs(resp), logprobs(solo)) < 1e-5

        # retract: a running request loses its KV cache, waits, and is re-prefilled from prompt + tokens so far.
        running = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": n}, return_logprob=True))
        await wait_running(c, len(prompt) + 30)
        await c.pause_generation("retract")
        await asyncio.sleep(0.2)
        load = (await c.get_load())[0]
        assert load["num_waiting_reqs"] == 1 and load["num_tokens"] == 0
        await c.continue_generation()
        resp = await running
        assert tokens(resp) == tokens(solo) and mean_abs_diff(logprobs(resp), logprobs(solo)) < 1e-5

        # abort (the default): running requests end with abort; new ones wait for continue.
        running = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": 3000}))
        await wait_running(c, len(prompt) + 10)
        await c.pause_generation()
        assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"
        later = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": 5}))
        await asyncio.sleep(0.2)
        assert not later.done()
        await c.continue_generation()
        assert tokens(await later) == tokens(solo)[:5]


async def test_update_weights_from_disk(engine, models):
    prompt = PROMPTS[1]
    ref_a = reference_greedy(models["model_a"], prompt, 20)
    ref_b = reference_greedy(models["model_b"], prompt, 20)
    assert ref_a != ref_b
    async with SGLangClient(engine.url) as c:
        resp = await c.update_weights_from_disk(str(models["b"]))
        assert resp["success"] and await c.get_weight_version() == "1"
        out = await c.generate(prompt, {**GREEDY, "max_new_tokens": 20})
        assert tokens(out) == ref_b and out["meta_info"]["weight_version"] == "1"
        assert (await c.model_info())["model_path"] == str(models["b"].resolve())

        await c.update_weights_from_disk(str(models["a"]), weight_version="7")
        assert await c.get_weight_version() == "7"
        assert tokens(await c.generate(prompt, {**GREEDY, "max_new_tokens": 20})) == ref_a

        with pytest.raises(EngineError) as err:
            await c.update_weights_from_disk("/nonexistent/checkpoint")
        assert err.value.status == 400 and err.value.body["success"] is False
        assert await c.get_weight_version() == "7"


async def test_update_waits_for_running_requests(engine, models):
    """An update arriving mid-generation applies after the batch drains: no response mixes two versions."""
    prompt = PROMPTS[1]
    async with SGLangClient(engine.url) as c:
        running = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": 150}))
        await wait_running(c, len(prompt) + 10)
        await c.update_weights_from_disk(str(models["b"]), weight_version="b")
        first = await running
        assert tokens(first) == reference_greedy(models["model_a"], prompt, 150)
        assert first["meta_info"]["weight_version"] == "7"
        await c.update_weights_from_disk(str(models["a"]), weight_version="7")


async def test_update_weights_from_tensor(engine, models):
    prompt = PROMPTS[0]
    weights_b = read_checkpoint(str(models["b"]))
    weights_a = read_checkpoint(str(models["a"]))
    async with SGLangClient(engine.url) as c:
        names = sorted(weights_b)
        # Two buckets, the version named on the last one only (as a trainer would send them).
        await c.update_weights_from_tensor({n: weights_b[n] for n in names[:10]})
        assert await c.get_weight_version() == "7"
        await c.update_weights_from_tensor({n: weights_b[n] for n in names[10:]}, weight_version="8")
        assert await c.get_weight_version() == "8"
        out = await c.generate(prompt, {**GREEDY, "max_new_tokens": 20})
        assert tokens(out) == reference_greedy(models["model_b"], prompt, 20)

        with pytest.raises(EngineError, match="unknown weight"):
            await c.update_weights_from_tensor({"model.no_such.weight": weights_a[names[0]]})
        with pytest.raises(EngineError, match="shape"):
            await c.update_weights_from_tensor({"model.norm.weight": weights_a["model.norm.weight"][:3]})
        with pytest.raises(EngineError, match="base64 safetensors"):
            await c.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["not-a-blob"]})

        await c.update_weights_from_tensor(weights_a, weight_version="7")
        assert tokens(await c.generate(prompt, {**GREEDY, "max_new_tokens": 20})) == \
            reference_greedy(models["model_a"], prompt, 20)


async def test_update_weights_from_distributed(engine, models):
    port = free_port()
    weights_b = read_checkpoint(str(models["b"]))
    names = sorted(weights_b)
    sender = subprocess.Popen(
        [sys.executable, "-c", f"from tests.rollout.helpers import send_weights; send_weights({port}, "
                               f"{str(models['b'])!r})"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        async with SGLangClient(engine.url, timeout_s=120) as c:
            joined = await c.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
            assert joined["success"]
            with pytest.raises(EngineError, match="exists"):
                await c.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
            with pytest.raises(EngineError, match="no weight update group"):
                await c.update_weights_from_distributed(names, ["float32"], [[1]], group_name="other")
            resp = await c.update_weights_from_distributed(
                names, [dtype_name(weights_b[n].dtype) for n in names], [list(weights_b[n].shape) for n in names],
                weight_version="9")
            assert resp["success"] and await c.get_weight_version() == "9"
            out = await c.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 20})
            assert tokens(out) == reference_greedy(models["model_b"], PROMPTS[2], 20)
            sender_out, _ = sender.communicate("done\n", timeout=60)
            assert sender.returncode == 0, sender_out
            assert (await c.destroy_weights_update_group())["success"]
            await c.update_weights_from_disk(str(models["a"]), weight_version="7")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()


async def test_release_and_resume_memory(engine, models):
    prompt = PROMPTS[3]
    async with SGLangClient(engine.url) as c:
        assert (await c.release_memory_occupation())["success"]
        assert (await c.server_info())["memory_released"] == ["kv_cache", "weights"]
        assert await c.health()
        held = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": 12}))
        await asyncio.sleep(0.3)
        assert not held.done()
        # An update while released writes into the parked weights.
        await c.update_weights_from_tensor(read_checkpoint(str(models["b"])), weight_version="10")
        assert (await c.resume_memory_occupation())["success"]
        assert tokens(await held) == reference_greedy(models["model_b"], prompt, 12)

        # Requests paused in place hold a KV cache: releasing then is refused.
        paused = asyncio.create_task(c.generate(prompt, {**GREEDY, "max_new_tokens": 3000}))
        await wait_running(c, len(prompt) + 5)
        await c.pause_generation("in_place")
        with pytest.raises(EngineError, match="paused in place"):
            await c.release_memory_occupation(["weights"])
        await c.pause_generation("abort")
        assert (await paused)["meta_info"]["finish_reason"]["type"] == "abort"
        await c.continue_generation()
        await c.update_weights_from_disk(str(models["a"]), weight_version="7")
        assert tokens(await c.generate(prompt, {**GREEDY, "max_new_tokens": 12})) == \
            reference_greedy(models["model_a"], prompt, 12)
