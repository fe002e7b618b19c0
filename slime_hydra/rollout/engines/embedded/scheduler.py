"""The embedded engine's scheduler: ``Engine`` takes requests from the HTTP handlers and decides, one step boundary at
a time, what its ``ModelRunner`` does next on the model thread.

State it owns: the waiting queue (FIFO), every live request by rid (waiting or running), pending control operations
(weight updates, memory release/resume) and the flags that aborts, pauses and retracts leave for the next boundary.
Each iteration of ``_schedule_forever`` does, in order: finish aborted requests, retract the batch if asked, run the
first control operation if it may run now (a draining one waits for an empty batch unless generation is paused),
otherwise admit waiting requests into free rows (none while a control operation waits; only those that run with the
batch's LoRA adapter, the next one's put in place once the batch is empty) and run a prefill if anything was
admitted, else decode steps of the batch, on the model thread, until a request finishes or any of the above waits
for a step boundary (``_decode_until_news``). A decode step leaves its tokens in flight (the runner takes them
in during the next step); before anything else touches the batch (aborts, retracts, control operations, going
idle) the scheduler has the runner settle it. Nothing steps while generation is paused or the weights are
released; with nothing to do it sleeps until woken. Finished requests are answered here (``protocol.response``); a
failed step fails only the requests it touched, a scheduler error fails everything and turns /health to 503.
"""

import asyncio
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch

from slime_hydra import heap
from slime_hydra.rollout.engines.embedded.protocol import Request, RequestError, SamplingParams, response
from slime_hydra.rollout.engines.embedded.runner import ModelRunner

logger = logging.getLogger("slime_hydra.engine")

PAUSE_MODES = ("abort", "in_place", "retract")
STEP_KINDS = ("prefill", "decode", "settle")


@dataclass
class StepTimes:
    """Totals of one kind of runner step since the engine started (``server_info``'s ``internal_states``): how many
    ran and in how many hand-offs, seconds they ran on the model thread, seconds the scheduler waited for them (the
    difference is the hand-offs between the event loop and the model thread) and seconds it then spent answering the
    requests they finished. A client diffs two readings to see where an interval went."""
    steps: int = 0
    runs: int = 0
    """Hand-offs to the model thread (a run of decode steps is one, ``Engine._decode_until_news``)."""
    model_s: float = 0.0
    wait_s: float = 0.0
    answer_s: float = 0.0


@dataclass
class _Control:
    """A model-thread operation the scheduler runs at a step boundary (weights, memory)."""
    fn: Callable[[], Any]
    drain: bool
    """Wait until the running batch is empty, unless generation is paused in place."""
    future: asyncio.Future


class Engine:
    """A ModelRunner behind a dynamic-batching scheduler; the HTTP layer (``build_app``) is a thin shell around it."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", max_batch_size: int = 64,
                 context_length: Optional[int] = None, tokenizer_path: Optional[str] = None,
                 weight_version: str = "0", host: str = "127.0.0.1", port: int = 0, cuda_graph: bool = True,
                 lora: Optional[dict] = None, return_routed_experts: bool = False,
                 torch_compile: Optional[bool] = None, freeze_heap: bool = False, batch_invariant: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.runner = ModelRunner(model_path, device, dtype, max_batch_size, context_length, tokenizer_path,
                                  weight_version, cuda_graph, lora, return_routed_experts, torch_compile,
                                  batch_invariant)
        self.max_batch_size = max_batch_size
        self.host, self.port = host, port
        self.paused = False
        self._waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}
        """Waiting and running requests by rid."""
        self._controls: deque[_Control] = deque()
        self._abort_pending = False
        self._retract_pending = False
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._dead: Optional[str] = None
        self.adapter_paths: dict[str, str] = {}
        """Named adapters that requests may use (``lora_path``) -> the directory each was loaded from."""
        self._finished: Optional[asyncio.Event] = None
        """Set whenever a request ends (an unload waits for the requests using its adapter)."""
        self.generated_tokens = 0
        self.started = time.time()
        self.step_times = {kind: StepTimes() for kind in STEP_KINDS}
        self._stopping = False
        self.gc_times = heap.GcTimes()
        self.freeze_heap = freeze_heap
        """The engine owns its process: freeze the heap now and after every step that captured a graph
        (``heap.freeze``)."""
        if freeze_heap:
            heap.freeze()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake, self._finished = asyncio.Event(), asyncio.Event()
        self.gc_times.start()
        self._task = asyncio.create_task(self._schedule_forever(), name="scheduler")

    async def stop(self) -> None:
        self._stopping = True  # ends a run of decode steps on the model thread at the next step
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A step may still be running on the model thread: fail the futures, leave its batch alone.
        self._fail_everything("engine shutting down", clear_batch=False)
        self.runner.weights.leave_groups()
        self.gc_times.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._task is not None and not self._task.done()

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the scheduler stopped (None while it runs)."""
        return self._dead

    # -- requests --------------------------------------------------------------------------------------------------

    def make_request(self, prompt, params: Optional[dict], rid: Optional[str], return_logprob: bool,
                     logprob_start_len: int, top_logprobs_num: int, return_text_in_logprobs: bool,
                     lora_path: Optional[str] = None, return_routed_experts: Optional[bool] = None) -> Request:
        """Validate one prompt's fields (RequestError on any problem) and build its Request."""
        runner = self.runner
        if lora_path is not None and lora_path not in self.adapter_paths:
            raise RequestError(f"LoRA adapter {lora_path!r} is not loaded (loaded: {sorted(self.adapter_paths)}); "
                               "load it with /load_lora_adapter")
        if return_routed_experts and runner.routing is None:
            raise RequestError("return_routed_experts needs the engine started with --enable-return-routed-experts")
        if isinstance(prompt, str):
            if runner.tokenizer is None:
                raise RequestError("text prompts need a tokenizer in the model directory; send input_ids")
            prompt_ids = list(runner.tokenizer.encode(prompt))
        else:
            prompt_ids = prompt
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            raise RequestError("input_ids must be a non-empty list of integers (or a list of such lists)")
        bad = [t for t in prompt_ids if not 0 <= t < runner.vocab_size]
        if bad:
            raise RequestError(f"input_ids {bad[:8]} outside the vocabulary [0, {runner.vocab_size})")
        if len(prompt_ids) >= runner.context_length:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context length "
                               f"{runner.context_length}")
        sampling = SamplingParams.from_dict(params)
        if sampling.stop and runner.tokenizer is None:
            raise RequestError("stop strings need a tokenizer in the model directory; use stop_token_ids")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise RequestError(f"logprob_start_len={logprob_start_len!r} must be an integer >= -1")
        if logprob_start_len >= len(prompt_ids):
            raise RequestError(f"logprob_start_len={logprob_start_len} must be below the prompt length "
                               f"{len(prompt_ids)}")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise RequestError(f"top_logprobs_num={top_logprobs_num!r} must be an integer >= 0")
        rid = uuid.uuid4().hex if rid is None else rid
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"rid={rid!r} must be a non-empty string")
        if rid in self._live:
            raise RequestError(f"rid {rid!r} is already running")
        generator = None
        if sampling.sampling_seed is not None:
            generator = torch.Generator(device=runner.device).manual_seed(sampling.sampling_seed)
        return Request(rid, prompt_ids, sampling, bool(return_logprob), logprob_start_len,
                       min(top_logprobs_num, runner.vocab_size), bool(return_text_in_logprobs), generator, lora_path,
                       runner.routing is not None if return_routed_experts is None else bool(return_routed_experts))

    def submit(self, reqs: list[Request]) -> None:
        if not self.healthy:
            raise RuntimeError(f"engine scheduler is down: {self._dead}")
        seen = set()
        for r in reqs:
            if r.rid in self._live or r.rid in seen:
                raise RequestError(f"rid {r.rid!r} is already running")
            seen.add(r.rid)
        for r in reqs:
            self._live[r.rid] = r
            self._waiting.append(r)
        self._wake.set()

    def abort(self, rid: Optional[str] = None, abort_all: bool = False, message: str = "aborted by request") -> int:
        """Mark requests to end at the next step boundary; return how many were marked."""
        targets = list(self._live.values()) if abort_all else [self._live[rid]] if rid in self._live else []
        for r in targets:
            if r.abort_message is None and r.finish_reason is None:
                r.abort_message = message
        if targets:
            self._abort_pending = True
            self._wake.set()
        return len(targets)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r}; choose one of {PAUSE_MODES}")
        self.paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            self._retract_pending = True  # the batch belongs to the model thread until the step boundary
        self._wake.set()

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def load(self) -> dict:
        running = self.runner.running
        tokens = sum(r.num_tokens for r in running)
        running = len(running)
        return {"dp_rank": 0, "num_reqs": running + len(self._waiting), "num_waiting_reqs": len(self._waiting),
                "num_tokens": tokens}

    # -- control operations (weights, memory) ----------------------------------------------------------------------

    async def control(self, fn: Callable[[], Any], drain: bool) -> Any:
        """Run ``fn`` on the model thread at a step boundary (after the batch drains when ``drain``)."""
        if not self.healthy:
            raise RuntimeError(f"engine scheduler is down: {self._dead}")
        op = _Control(fn, drain, asyncio.get_running_loop().create_future())
        self._controls.append(op)
        self._wake.set()
        return await op.future

    # -- named LoRA adapters (SGLang's /load_lora_adapter and /unload_lora_adapter) ---------------------------------

    async def load_adapter(self, name: str, path: str, config: dict,
                           read: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Make adapter ``name`` usable by requests: ``path`` holds its adapter_config ``config`` and ``read()``
        returns its tensors (called only once the config fits); RequestError if the name is taken or the adapter
        does not fit the served adapter modules."""
        if name in self.adapter_paths:
            raise RequestError(f"LoRA adapter {name!r} is already loaded; unload it first")
        problems = self.runner.weights.adapter_problems(config)
        if problems:
            raise RequestError(f"LoRA adapter {name!r} ({path}): " + "; ".join(problems))
        named = await asyncio.to_thread(read)
        await self.control(lambda: self.runner.weights.add_adapter(name, named), drain=False)
        self.adapter_paths[name] = path

    async def unload_adapter(self, name: str) -> None:
        """New requests may no longer name the adapter at once; it is dropped when the requests using it have ended
        (as SGLang does: an unload waits for them, paused ones included)."""
        if name not in self.adapter_paths:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.adapter_paths)})")
        del self.adapter_paths[name]
        while any(r.adapter == name for r in self._live.values()):
            self._finished.clear()
            await self._finished.wait()
        await self.control(lambda: self.runner.weights.drop_adapter(name), drain=False)

    # -- the scheduler ---------------------------------------------------------------------------------------------

    async def _schedule_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                if self._abort_pending or self._retract_pending or self._controls:
                    await self._settle(loop)
                if self._abort_pending:
                    await self._reap_aborted(loop)
                if self._retract_pending:
                    self._retract()
                if self._controls and self._control_may_run():
                    await self._run_control(loop, self._controls.popleft())
                    continue
                # A waiting control op (a weight update) lets the batch drain: nothing new is admitted meanwhile.
                stepping = not self.paused and "weights" not in self.runner.memory.released  # the cache: on demand
                admit = []
                if stepping and not self._controls:
                    await self._serve_adapter_of_next(loop)
                    room = self.max_batch_size - len(self.runner.running)
                    serving = self.runner.weights.serving
                    while self._waiting and len(admit) < room and self._waiting[0].adapter == serving:
                        admit.append(self._waiting.popleft())
                if admit or (stepping and self.runner.running):
                    await self._run_step(loop, admit)
                    continue
                if self.runner.in_flight:
                    await self._settle(loop)
                    continue
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a scheduler bug must surface as failed requests and a failing /health
            logger.exception("scheduler stopped")
            self._dead = f"{type(exc).__name__}: {exc}"
            self._fail_everything(f"engine scheduler stopped: {self._dead}")

    async def _serve_adapter_of_next(self, loop) -> None:
        """A batch runs with one adapter: once it is empty, the next request's adapter goes into the model (the queue
        stays FIFO: a request with another adapter waits for the batch to finish, and so do those behind it)."""
        if self._waiting and not self.runner.running and self._waiting[0].adapter != self.runner.weights.serving:
            await loop.run_in_executor(self._executor, self.runner.weights.activate, self._waiting[0].adapter)

    def _retract(self) -> None:
        """Running requests go back to the queue front with their tokens; re-admission prefills prompt + tokens."""
        self._retract_pending = False
        self._waiting.extendleft(reversed(self.runner.clear_batch()))

    def _control_may_run(self) -> bool:
        op = self._controls[0]
        return not op.drain or not self.runner.running or self.paused

    async def _run_control(self, loop, op: _Control) -> None:
        try:
            result = await loop.run_in_executor(self._executor, op.fn)
        except Exception as exc:
            if not op.future.done():
                op.future.set_exception(exc)
        else:
            if not op.future.done():
                op.future.set_result(result)

    async def _settle(self, loop) -> None:
        """Take in the decode step in flight (runner.settle) before the batch is touched otherwise."""
        if self.runner.in_flight:
            await self._run_step(loop, None)

    async def _run_step(self, loop, admit: Optional[list[Request]]) -> None:
        """One runner step (admit None: only settle the step in flight; admit []: decode steps until one finishes a
        request or the scheduler has news, ``_decode_until_news``) and answer the requests that finished."""
        times = self.step_times["settle" if admit is None else "prefill" if admit else "decode"]
        work = (self.runner.settle if admit is None else partial(self.runner.step, admit) if admit
                else partial(self._decode_until_news, times))
        captures = self._captures() if self.freeze_heap else None

        def timed():
            start = time.perf_counter()
            try:
                return work()
            finally:
                times.model_s += time.perf_counter() - start

        start = time.perf_counter()
        try:
            finished = await loop.run_in_executor(self._executor, timed)
        except Exception as exc:
            # The step's tensors are in an unknown state: fail the requests it touched, keep serving the rest.
            logger.exception("model step failed")
            victims = (admit or []) + self.runner.clear_batch()
            for r in victims:
                self._fail(r, f"model step failed: {type(exc).__name__}: {exc}")
            return
        finally:
            if admit != []:  # a run of decode steps counts its own
                times.steps += 1
            times.runs += 1
            times.wait_s += time.perf_counter() - start
            if captures is not None and self._captures() != captures:
                heap.freeze()
        start = time.perf_counter()
        for r in finished:
            self._complete(r)
        times.answer_s += time.perf_counter() - start

    def _decode_until_news(self, times: StepTimes) -> list[Request]:
        """Decode steps, on the model thread, until one finishes a request or something waits for a step boundary:
        a request that could be admitted, a control operation, an abort, a retract, a pause or the engine stopping
        (the flags the event loop sets; each step reads them afresh). One hand-off to the event loop per run instead
        of one per step: on one H200 the per-step hand-offs took 7-11% of a bench round, on another almost nothing
        (docs/benchmarks.md). Counts each step in ``times`` (a failed one included)."""
        while True:
            times.steps += 1
            finished = self.runner.step([])
            if (finished or not self.runner.running or self._stopping or self._controls or self._abort_pending
                    or self._retract_pending or self.paused
                    or (self._waiting and len(self.runner.running) < self.max_batch_size)):
                return finished

    async def _reap_aborted(self, loop) -> None:
        self._abort_pending = False
        kept = deque()
        for r in self._waiting:
            if r.abort_message is not None:
                r.finish_reason = {"type": "abort", "message": r.abort_message}
                self._complete(r)
            else:
                kept.append(r)
        self._waiting = kept
        if any(r.abort_message is not None for r in self.runner.running):
            gone = await loop.run_in_executor(self._executor, self.runner.drop_aborted)
            for r in gone:
                self._complete(r)

    def _complete(self, r: Request) -> None:
        self._live.pop(r.rid, None)
        self._finished.set()
        self.generated_tokens += len(r.output_ids)
        if not r.future.done():
            r.future.set_result(response(r, self.runner.tokenizer, self.runner.weight_version))

    def _fail(self, r: Request, message: str) -> None:
        self._live.pop(r.rid, None)
        self._finished.set()
        if not r.future.done():
            r.future.set_exception(RuntimeError(message))

    def _fail_everything(self, message: str, clear_batch: bool = True) -> None:
        for r in list(self._live.values()):
            self._fail(r, message)
        self._waiting.clear()
        if clear_batch:
            self.runner.clear_batch()
        while self._controls:
            op = self._controls.popleft()
            if not op.future.done():
                op.future.set_exception(RuntimeError(message))

    # -- descriptions ----------------------------------------------------------------------------------------------

    def _captures(self) -> int:
        """CUDA graphs captured since the engine started."""
        return sum(g.captures for g in self.runner.step_graphs)

    def server_info(self) -> dict:
        runner = self.runner
        elapsed = max(time.time() - self.started, 1e-9)
        memory = {}
        if runner.device.type == "cuda":
            memory["memory_allocated_bytes"] = torch.cuda.memory_allocated(runner.device)
            memory["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(runner.device)
            memory["device_free_bytes"] = torch.cuda.mem_get_info(runner.device)[0]  # a release shows here
        return {**memory, "engine": "slime_hydra.embedded", "model_path": runner.model_path,
                "tokenizer_path": runner.tokenizer_path, "served_model_name": runner.model_path, "host": self.host,
                "port": self.port, "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
                "torch_threads": torch.get_num_threads(), "tp_size": 1, "dp_size": 1,
                "max_running_requests": self.max_batch_size, "context_length": runner.context_length,
                "skip_tokenizer_init": runner.tokenizer is None, "weight_version": runner.weight_version,
                "paused": self.paused, "memory_released": sorted(runner.memory.released),
                "lora_adapters": sorted(self.adapter_paths), "torch_compile": runner.compiled,
                "batch_invariant": runner.batch_invariant,
                "cuda_graph": runner.graphs is not None and runner.graphs.failed is None,
                "cuda_graph_captures": self._captures(),
                "kv_capacity_tokens": runner.kv.capacity,
                "internal_states": [{"generated_tokens": self.generated_tokens,
                                     "step_times": {k: asdict(v) for k, v in self.step_times.items()},
                                     "gc": self.gc_times.as_dict(),
                                     "peak_running_reqs": runner.peak_running,
                                     "avg_gen_throughput": self.generated_tokens / elapsed, **self.load()}]}
