"""Async HTTP client for servers speaking SGLang's native protocol: sglang-router, or one engine behind it.

Rollout code sends ``/generate`` through the router (one ``SGLangClient`` on the router's URL) and control calls
(abort, pause, weight updates, memory) to each engine directly: sglang-router 0.3.2 answers 404 for
``/abort_request``, ``/pause_generation``, ``/update_weights_*`` and ``/get_weight_version``, and fans out only
``/flush_cache``. The same client class serves both; the engine may be the embedded one or real SGLang. Given the
run's API key (rollout/auth.py), every call carries it as ``Authorization: Bearer <key>``.

Errors: ``EngineUnavailable`` (nothing answers: refused, reset), ``EngineTimeout`` (no answer within the timeout),
``EngineError`` (an answer with an error status, or ``"success": false``); each names the method, URL and the
server's message.
"""

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

import aiohttp

from slime_hydra.rollout.auth import bearer

if TYPE_CHECKING:  # torch loads only where tensors are sent (update_weights_from_tensor): the rollout manager of a
    import torch   # run that syncs by broadcast or disk never imports it (~2.5 s of CPU)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What /release_memory_occupation and /resume_memory_occupation name (SGLang's tags; no tags: all of them)."""

Response = dict[str, Any]


class EngineError(RuntimeError):
    """An engine or router answered with an error (``status`` and ``body`` say which)."""

    def __init__(self, message: str, url: str = "", status: Optional[int] = None, body: Any = None):
        super().__init__(message)
        self.url, self.status, self.body = url, status, body


class EngineUnavailable(EngineError):
    """Nothing answered at the URL (connection refused or reset)."""


class EngineTimeout(EngineError):
    """The server did not answer within the timeout."""


def _server_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "error_message"):  # weight updates answer the first, LoRA updates the second
            if body.get(key):
                return str(body[key])
    return str(body)[:2000]


class SGLangClient:
    """Calls one server (router or engine) at ``base_url``; reuse one instance, close it when done.

    timeout_s: default total time for a call (a long generation counts); each call may override it.
    connect_timeout_s: time to open a connection. max_connections: concurrent connections to this server.
    api_key: the run's key, sent with every call (None: the server requires none).
    lora_path: the LoRA adapter every /generate runs with (a name /load_lora_adapter loaded; None: the model as
    served); the rollout manager sets it at each adapter sync (rollout/weight_relay.py).
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 max_connections: int = 1024, api_key: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self.headers = bearer(api_key)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.lora_path: Optional[str] = None
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        # Created lazily: a session belongs to the event loop that is running when it is made.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                                  headers=self.headers)
        return self._session

    async def request(self, method: str, path: str, payload: Optional[Mapping] = None,
                      timeout_s: Optional[float] = None) -> Any:
        """Send one call; return the decoded JSON body (or text, or None when empty). Raises the errors above."""
        url = f"{self.base_url}{path}"
        limit = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.connect_timeout_s)
        try:
            async with self._session_now().request(method, url, json=payload, timeout=timeout) as resp:
                raw = await resp.read()
                body: Any = None
                if raw:
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        body = raw.decode(errors="replace")
                if resp.status >= 400:
                    raise EngineError(f"{method} {url} -> {resp.status}: {_server_message(body)}", url, resp.status,
                                      body)
                if isinstance(body, dict) and body.get("success") is False:
                    raise EngineError(f"{method} {url} failed: {_server_message(body)}", url, resp.status, body)
                return body
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"{method} {url}: no answer within {limit:.1f} s", url) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as exc:
            raise EngineUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}", url) from exc

    # -- generation -------------------------------------------------------------------------------------------------

    async def generate(self, input_ids: Union[Sequence[int], Sequence[Sequence[int]]],
                       sampling_params: Optional[Union[Mapping, Sequence[Mapping]]] = None,
                       return_logprob: bool = False, rid: Optional[Union[str, Sequence[str]]] = None, *,
                       top_logprobs_num: Optional[int] = None, logprob_start_len: Optional[int] = None,
                       return_text_in_logprobs: Optional[bool] = None,
                       timeout_s: Optional[float] = None) -> Union[Response, list[Response]]:
        """POST /generate with token ids: one prompt -> one response dict, a list of prompts -> a list.

        Through sglang-router a batch must not carry ``rid`` (the router accepts only one string) and shares one
        ``sampling_params`` dict; an engine addressed directly accepts lists for both.
        """
        batched = len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple))
        payload = {"input_ids": [[int(t) for t in p] for p in input_ids] if batched else [int(t) for t in input_ids]}
        return await self._generate(payload, sampling_params, return_logprob, rid, top_logprobs_num,
                                    logprob_start_len, return_text_in_logprobs, timeout_s)

    async def generate_text(self, text: Union[str, Sequence[str]],
                            sampling_params: Optional[Union[Mapping, Sequence[Mapping]]] = None,
                            return_logprob: bool = False, rid: Optional[Union[str, Sequence[str]]] = None, *,
                            top_logprobs_num: Optional[int] = None, logprob_start_len: Optional[int] = None,
                            return_text_in_logprobs: Optional[bool] = None,
                            timeout_s: Optional[float] = None) -> Union[Response, list[Response]]:
        """POST /generate with text (the server tokenizes it); otherwise as ``generate``."""
        payload = {"text": text if isinstance(text, str) else list(text)}
        return await self._generate(payload, sampling_params, return_logprob, rid, top_logprobs_num,
                                    logprob_start_len, return_text_in_logprobs, timeout_s)

    async def _generate(self, payload: dict, sampling_params, return_logprob, rid, top_logprobs_num,
                        logprob_start_len, return_text_in_logprobs, timeout_s):
        payload["sampling_params"] = (dict(sampling_params or {}) if not isinstance(sampling_params, (list, tuple))
                                      else [dict(p) for p in sampling_params])
        payload["return_logprob"] = bool(return_logprob)
        optional = {"rid": rid, "top_logprobs_num": top_logprobs_num, "logprob_start_len": logprob_start_len,
                    "return_text_in_logprobs": return_text_in_logprobs, "lora_path": self.lora_path}
        payload.update({k: v for k, v in optional.items() if v is not None})
        return await self.request("POST", "/generate", payload, timeout_s)

    async def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> Any:
        """POST /abort_request: end one request (by rid) or all; they answer with finish_reason abort."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        payload = {"abort_all": True} if abort_all else {"rid": rid}
        return await self.request("POST", "/abort_request", payload)

    async def pause_generation(self, mode: str = "abort") -> Any:
        """POST /pause_generation: mode abort | in_place | retract."""
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    # -- state ------------------------------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when GET /health answers 200 (never raises)."""
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Poll /health until it answers 200; EngineTimeout after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not await self.health(timeout_s=max(1.0, min(5.0, timeout_s))):
            if time.monotonic() > deadline:
                raise EngineTimeout(f"{self.base_url}/health not 200 within {timeout_s:.0f} s", self.base_url)
            await asyncio.sleep(poll_s)

    async def health_generate(self, timeout_s: float = 90.0) -> Any:
        return await self.request("GET", "/health_generate", timeout_s=timeout_s)

    async def model_info(self) -> Response:
        return await self.request("GET", "/model_info")

    async def server_info(self) -> Response:
        return await self.request("GET", "/server_info")

    async def get_load(self) -> Any:
        return await self.request("GET", "/get_load")

    async def get_weight_version(self) -> str:
        body = await self.request("GET", "/get_weight_version")
        return str(body["weight_version"])

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache")

    # -- weights and memory -----------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False, timeout_s: Optional[float] = None) -> Any:
        payload = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_disk", payload, timeout_s)

    async def update_weights_from_tensor(self, named_tensors: Union[Mapping[str, "torch.Tensor"],
                                                                    Iterable[tuple[str, "torch.Tensor"]]],
                                         weight_version: Optional[str] = None, flush_cache: bool = True,
                                         abort_all_requests: bool = False, timeout_s: Optional[float] = None) -> Any:
        """Send tensors in the request body (base64 safetensors: the embedded engine's format)."""
        from slime_hydra.weight_transport import encode_named_tensors

        payload = {"serialized_named_tensors": [encode_named_tensors(named_tensors)], "flush_cache": flush_cache,
                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_tensor", payload, timeout_s)

    async def update_weights_from_cuda_ipc(self, handles: Sequence[Mapping], weight_version: Optional[str] = None,
                                           flush_cache: bool = True, timeout_s: Optional[float] = None) -> Any:
        """Point the engine at tensors in the trainer's GPU memory (``weight_transport.share_cuda_bucket`` entries,
        one per trainer GPU); returns once it has copied them, after which the trainer may free the buffers."""
        payload = {"serialized_named_tensors": [json.dumps(list(handles))], "load_format": "cuda_ipc",
                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_tensor", payload, timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo", timeout_s: Optional[float] = None) -> Any:
        """Ask the engine to join the group; returns once every rank (the trainer too) has joined."""
        payload = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                   "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return await self.request("POST", "/init_weights_update_group", payload, timeout_s)

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: Optional[str] = None, flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              timeout_s: Optional[float] = None) -> Any:
        """Announce the tensors rank 0 is about to broadcast (in this order); returns once they are loaded."""
        payload = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                   "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_distributed", payload, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> Any:
        """POST /update_weight_version: relabel the served weights (a named adapter's sync sets no version itself)."""
        return await self.request("POST", "/update_weight_version",
                                  {"new_version": str(version), "abort_all_requests": abort_all_requests})

    async def load_lora_adapter(self, name: str, path: str, timeout_s: Optional[float] = None) -> Any:
        """POST /load_lora_adapter: read the PEFT adapter directory ``path`` as adapter ``name``."""
        return await self.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                  timeout_s)

    async def unload_lora_adapter(self, name: str, timeout_s: Optional[float] = None) -> Any:
        """POST /unload_lora_adapter: returns once the requests using the adapter have ended and it is dropped."""
        return await self.request("POST", "/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> Any:
        return await self.request("POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {})

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {})
