"""The embedded engine's HTTP server: the aiohttp routes of the endpoints the package docstring lists (``build_app``),
each a thin shell over the ``Engine`` (requests, pauses, control operations) and its ``ModelRunner`` (the weight and
memory operations the control operations run), plus ``read_checkpoint`` (and ``read_through_transformers``) for
/update_weights_from_disk.

Errors: a ``RequestError`` is answered 400 and any other exception 500, as ``{"error": {"message"}}``, except on the
weight endpoints (``/update_weights*``, ``/init_weights*``, ``/destroy_weights*``), which answer SGLang's
``{"success": false, "message"}``, and the LoRA ones (``/load_lora_adapter``, ``/unload_lora_adapter``), which answer
SGLang's ``{"success": false, "error_message"}`` with 400. A client that disconnects from /generate aborts its requests.

The API key (``rollout/auth.py``): with one, every endpoint but ``/health*`` answers 401 (``{"error": {"message"}}``
saying what to send) to a request without ``Authorization: Bearer <key>``, before the request is read, so a refused
request changes nothing; without one, everything is open.
"""

import asyncio
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from aiohttp import web

from slime_hydra.rollout.auth import API_KEY_ENV, OPEN_PREFIX, authorized
from slime_hydra.rollout.client import MEMORY_TAGS
from slime_hydra.rollout.engines.embedded.protocol import RequestError, parse_generate
from slime_hydra.rollout.engines.embedded.scheduler import Engine
from slime_hydra.weight_transport import (
    decode_named_tensors, init_weight_update_group, open_cuda_bucket, recv_named_tensors, split_adapter_key,
)

logger = logging.getLogger("slime_hydra.engine")


LORA_UPDATES = ("/load_lora_adapter", "/unload_lora_adapter")


def _lora_outcome(engine: Engine) -> web.Response:
    return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(engine.adapter_paths)})


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _outcome(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    return body


def _as_request_error(fn: Callable) -> Callable:
    """``fn`` with its ValueErrors (malformed request data) turned into RequestErrors (400)."""
    def wrapped(*args):
        try:
            return fn(*args)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
    return wrapped


def build_app(engine: Engine, max_request_mb: int = 4096, api_key: Optional[str] = None) -> web.Application:
    """The engine's aiohttp application; ``api_key``: required on every endpoint but /health* (None: none)."""
    runner = engine.runner
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request):
        return web.Response(status=200) if engine.healthy else _error(f"scheduler down: {engine.dead_reason}", 503)

    @routes.get("/health_generate")
    async def health_generate(request):
        if not engine.healthy:
            return _error(f"scheduler down: {engine.dead_reason}", 503)
        if engine.paused or runner.memory.released:  # deliberately idle: a probe would wait for continue/resume
            return web.Response(status=200)
        probe = engine.make_request([0], {"max_new_tokens": 1, "temperature": 0}, None, False, -1, 0, False)
        engine.submit([probe])
        try:
            await asyncio.wait_for(asyncio.shield(probe.future), timeout=60)
        except asyncio.TimeoutError:
            engine.abort(probe.rid, message="health probe timed out")
            return _error("a one-token generation did not finish within 60 s", 503)
        return web.Response(status=200)

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info(request):
        return web.json_response(runner.model_info())

    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def server_info(request):
        return web.json_response(engine.server_info())

    @routes.get("/get_load")
    async def get_load(request):
        return web.json_response([engine.load()])

    @routes.get("/get_weight_version")
    async def get_weight_version(request):
        return web.json_response({"weight_version": runner.weight_version})

    @routes.post("/generate")
    async def generate(request):
        reqs, batched = parse_generate(await _body(request), engine.make_request)
        engine.submit(reqs)
        try:
            results = await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # the client went away: stop spending steps on it
            for r in reqs:
                engine.abort(r.rid, message="client disconnected")
            raise
        return web.json_response(results if batched else results[0])

    @routes.post("/abort_request")
    async def abort_request(request):
        body = await _body(request)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid={rid!r} must be a string (or send abort_all: true)")
        n = engine.abort(rid, abort_all=bool(body.get("abort_all", False)))
        return web.json_response({"success": True, "num_aborted": n})

    @routes.get("/flush_cache")
    @routes.post("/flush_cache")
    async def flush_cache(request):
        return _outcome(True, "Cache flushed (the embedded engine keeps no prefix cache).")

    @routes.post("/pause_generation")
    async def pause_generation(request):
        body = await _body(request)
        engine.pause(body.get("mode", "abort"))
        return _outcome(True, f"generation paused (mode={body.get('mode', 'abort')})")

    @routes.post("/continue_generation")
    async def continue_generation(request):
        engine.resume()
        return _outcome(True, "generation continued")

    def abort_first(body: dict) -> None:
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True, message="aborted for a weight update")

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(request):
        body = await _body(request)
        path = body.get("model_path")
        if not path or not Path(path).is_dir():
            raise RequestError(f"model_path={path!r} is not a directory")
        if body.get("load_format") not in (None, "auto"):
            raise RequestError(f"load_format={body['load_format']!r}: the embedded engine reads safetensors/bin")
        abort_first(body)
        named = await asyncio.to_thread(read_checkpoint, path)
        if all(split_adapter_key(name) for name in named):
            raise RequestError(f"{path} holds a LoRA adapter, not a model: load it with /load_lora_adapter")
        if not all(runner.weights.holds(name) for name in named):  # stored in another layout than the model holds
            named = await asyncio.to_thread(read_through_transformers, path, runner.dtype)

        def apply():
            runner.weights.load(named, complete=True)
            runner.set_version(body.get("weight_version"), bump=True)
            runner.model_path = str(Path(path).resolve())

        await engine.control(apply, drain=True)
        logger.info("weights loaded from %s; weight_version %s", path, runner.weight_version)
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors from {path}",
                                  "num_paused_requests": 0, "weight_version": runner.weight_version})

    @routes.post("/init_weights_update_group")
    async def init_weights_update_group(request):
        body = await _body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise RequestError(f"missing fields {missing}")
        name = body.get("group_name", "weight_update_group")
        runner.weights.check_new_group(name)
        backend = body.get("backend") or ("nccl" if runner.device.type == "cuda" else "gloo")
        join = _as_request_error(init_weight_update_group)
        group = await asyncio.to_thread(join, body["master_address"], int(body["master_port"]),
                                        int(body["rank_offset"]), int(body["world_size"]), name, backend,
                                        float(body.get("timeout_s", 300.0)), runner.device)
        runner.weights.add_group(name, group)
        logger.info("joined weight update group %s as rank %s of %s (%s)", name, body["rank_offset"],
                    body["world_size"], backend)
        return _outcome(True, f"joined {name} as rank {body['rank_offset']} of {body['world_size']} ({backend})")

    @routes.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request):
        body = await _body(request)
        name = body.get("group_name", "weight_update_group")
        await asyncio.to_thread(runner.weights.drop_group, name)
        return _outcome(True, f"left {name}")

    @routes.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request):
        body = await _body(request)
        group = runner.weights.group(body.get("group_name", "weight_update_group"))
        if "names" in body:
            names, dtypes, shapes = body["names"], body.get("dtypes"), body.get("shapes")
        elif "name" in body:
            names, dtypes, shapes = [body["name"]], [body.get("dtype")], [body.get("shape")]
        else:
            raise RequestError("give names/dtypes/shapes lists (or name/dtype/shape)")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise RequestError("names, dtypes and shapes must be lists of the same length")
        abort_first(body)
        # Receive while generation goes on (into fresh buffers); only the copy into the model waits for a boundary.
        named = await asyncio.to_thread(_as_request_error(recv_named_tensors), group, names, dtypes, shapes,
                                        runner.device)

        def apply():
            runner.weights.load(named, complete=False)
            runner.set_version(body.get("weight_version"), bump=False)

        await engine.control(apply, drain=True)
        logger.info("%d tensors received by broadcast; weight_version %s", len(named), runner.weight_version)
        return _outcome(True, f"received and loaded {len(named)} tensors")

    @routes.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request):
        body = await _body(request)
        payloads = body.get("serialized_named_tensors")
        fmt = body.get("load_format")
        if fmt not in (None, "cuda_ipc"):
            raise RequestError(f"load_format={fmt!r}: the embedded engine takes its default format (base64 "
                               "safetensors) or cuda_ipc (see slime_hydra/weight_transport.py)")
        if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
            raise RequestError("serialized_named_tensors must be a list with one string (the embedded engine has "
                               "one tensor-parallel rank): base64 safetensors, or with load_format=cuda_ipc a JSON "
                               "list of handles")
        abort_first(body)
        if fmt == "cuda_ipc":  # views of the trainer's buffer: load before answering, the sender keeps it alive
            named = _as_request_error(open_cuda_bucket)(payloads[0], runner.device)
        else:
            named = await asyncio.to_thread(_as_request_error(decode_named_tensors), payloads[0])

        def apply():
            runner.weights.load(named, complete=False)
            runner.set_version(body.get("weight_version"), bump=False)
            if fmt == "cuda_ipc":
                torch.cuda.current_stream(runner.device).synchronize()

        await engine.control(apply, drain=True)
        count = len(named)
        named.clear()  # drop the views so the IPC mapping closes now
        logger.info("%d tensors loaded from a request (%s); weight_version %s", count, fmt or "safetensors",
                    runner.weight_version)
        return _outcome(True, f"loaded {count} tensors")

    @routes.post("/update_weight_version")
    async def update_weight_version(request):
        body = await _body(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise RequestError(f"new_version={version!r} must be a non-empty string")
        if body.get("abort_all_requests", True):  # SGLang's default
            engine.abort(abort_all=True, message="aborted by update_weight_version")
        runner.set_version(version, bump=False)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    @routes.post("/load_lora_adapter")
    async def load_lora_adapter(request):
        body = await _body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise RequestError(f"lora_name={name!r} must be a non-empty string")
        if not isinstance(path, str) or not (Path(path) / "adapter_config.json").is_file():
            raise RequestError(f"lora_path={path!r} is not a PEFT adapter directory (no adapter_config.json)")
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        await engine.load_adapter(name, path, config, lambda: read_checkpoint(path))
        logger.info("LoRA adapter %s loaded from %s", name, path)
        return _lora_outcome(engine)

    @routes.post("/unload_lora_adapter")
    async def unload_lora_adapter(request):
        name = (await _body(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"lora_name={name!r} must be a non-empty string")
        await engine.unload_adapter(name)
        logger.info("LoRA adapter %s unloaded", name)
        return _lora_outcome(engine)

    def memory_tags(body: dict) -> list:
        tags = body.get("tags") or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"unknown tags {unknown}; choose from {MEMORY_TAGS}")
        return tags

    @routes.post("/release_memory_occupation")
    async def release_memory_occupation(request):
        tags = memory_tags(await _body(request))
        await engine.control(lambda: runner.release(tags), drain=True)
        logger.info("released %s", tags)
        return _outcome(True, f"released {tags}")

    @routes.post("/resume_memory_occupation")
    async def resume_memory_occupation(request):
        tags = memory_tags(await _body(request))
        await engine.control(lambda: runner.resume(tags), drain=False)
        logger.info("resumed %s", tags)
        return _outcome(True, f"resumed {tags}")

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except RequestError as exc:
            if request.path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return _outcome(False, str(exc))
            if request.path in LORA_UPDATES:  # SGLang's LoRAUpdateOutput, answered 400
                return web.json_response({"success": False, "error_message": str(exc), "loaded_adapters": None},
                                         status=400)
            return _error(str(exc), 400)
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            if request.path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=500)
            return _error(f"{type(exc).__name__}: {exc}", 500)

    @web.middleware
    async def require_key(request, handler):
        if api_key is None or request.path.startswith(OPEN_PREFIX):
            return await handler(request)
        if authorized(request.headers.get("Authorization"), api_key):
            return await handler(request)
        given = "a wrong key" if request.headers.get("Authorization") else "no key"
        return web.json_response(
            {"error": {"message": f"{request.method} {request.path} needs the run's API key and the request carried "
                                  f"{given}: send 'Authorization: Bearer <key>' (this engine read its key from "
                                  f"{API_KEY_ENV}; a run keeps it in <run_dir>/api_key)"}},
            status=401, headers={"WWW-Authenticate": "Bearer"})

    app = web.Application(middlewares=[require_key, errors], client_max_size=max_request_mb * 1024 * 1024)
    app.add_routes(routes)

    async def on_startup(app):
        await engine.start()

    async def on_cleanup(app):
        await engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def read_through_transformers(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory under the names transformers holds them by, on CPU. Some families
    store a layout of their own on disk that transformers converts while loading (Qwen3-MoE: one tensor per expert and
    projection in the files, one fused [experts, 2F, H] gate_up and [experts, H, F] down tensor in the model), which
    only transformers' loading knows: the checkpoint is loaded as a model and its state dict taken."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cpu").state_dict()


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (``*.safetensors``, else ``*.bin``), on CPU."""
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        return {name: t for f in files for name, t in load_file(str(f)).items()}
    files = sorted(root.glob("*.bin"))
    if files:
        return {name: t for f in files for name, t in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise RequestError(f"no *.safetensors or *.bin weights in {path}")
