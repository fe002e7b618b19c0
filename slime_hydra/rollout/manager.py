"""``RolloutManager``: prompts in, scored and filtered training groups out (the Ray actor the loop talks to).

It owns the router, the engines (through their ``EngineActor``s), the prompt source, the buffer, the reward and
the eval sets. One training batch::

    batch = await manager.generate_batch()     # {"samples": [...], "metrics": {...}}

runs the buffer's rounds (buffer/buffer.py): each round starts every group it was given (recycled ones first),
each group's samples generate concurrently through the router (at most ``max_concurrency_per_engine`` requests
in flight per engine), a group is scored as soon as all its samples are back, then handed to the buffer
(filters, staleness). Once the buffer holds ``batch_prompts`` kept groups, the rest of the round is aborted on
every engine (``/abort_request``; sglang-router does not forward it, so engines are called directly): their
partial samples come back aborted and the buffer recycles them (``rollout.partial_rollout``) or drops them.

A round whose groups are all done while samples still wait for a concurrency slot never sends those: once the
abort is decided they come back aborted without a request.

Fault tolerance. Every ``rollout.health_check_interval_s`` the manager checks each engine: its process is alive
(``EngineActor.alive``) and ``GET /health`` answers (3 failed answers in a row count as dead). A dead engine is
removed from the router at once (so retries go to the others), restarted on the same port
(``EngineActor.restart``: it comes back with the initial checkpoint), given the newest weights, and only then
added back to the router. The newest weights are replayed from what the manager kept of the last completed sync:

- ``disk``: the trainer's export directory and version (``/update_weights_from_disk`` again);
- ``tensor`` on CPU: the buckets pass through this actor, so it keeps the newest tensor of every name (one copy
  of the model in host memory) and sends them again;
- no sync yet: nothing to do (the initial checkpoint is version 0);
- ``distributed`` broadcast and CUDA IPC: the tensors never pass through the manager. The restarted engine stays
  out of the router until the next sync reaches it (``finish_weight_update`` adds it back); a distributed group
  that lost a member must be formed again by the trainer (``weight_group_stale``).

Replays and syncs exclude each other (a sync holds ``_weights_lock`` from ``begin_weight_update`` to
``finish_weight_update``; engines that are down are left out of it), so a restarted engine always ends on the
newest version. A ``/generate`` that cannot reach an engine (connection error, router 502/503/504) is retried
through the router up to ``rollout.max_generate_retries`` times (backoff 0.5 s, 1 s, 2 s ...; a health check runs
first, so a dead engine is out of the router by then). Each retry starts the sample again from its state before
the failed call (a copy taken before every call), so no sample keeps tokens of an engine's lost partial state;
the only tokens a sample carries across engines are those of a recycled partial rollout, which is what
``rollout.partial_rollout`` means. After the last retry the rollout stops with an error that names the engines
that were down and why. Counted in ``rollout/engine_restarts`` and ``rollout/generate_retries``.

Weights: ``update_weights_from_disk`` / ``init_weight_sync`` + ``update_weights_from_distributed`` /
``update_weights_from_tensor`` forward the trainer's weights to every engine; ``finish_weight_update(version)``
flushes their caches, sets the version and makes the buffer drop groups older than ``max_staleness``. During
async training a sync arrives while a rollout is running: generation is paused in place around it and
continues on the new weights.

Evaluation (``evaluate``): every ``data.eval`` set with its own samples per prompt, temperature and response
budget; metrics ``eval/<name>/accuracy`` (fraction of samples whose reward says correct: the dict's ``acc`` when
there is one, else scalar reward >= 1), ``eval/<name>/reward``, ``eval/<name>/response_len`` and, for k in
1, 2, 4 ... <= n, ``eval/<name>/pass@k`` with the unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over
prompts (c correct of n samples).

Checkpoint: ``state_dict()`` is JSON-safe: the prompt cursor and the buffer.
"""

import asyncio
import copy
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slime_hydra.buffer.buffer import RolloutBuffer
from slime_hydra.buffer.filters import get_filter
from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.data.dataset import PromptDataset, load_eval_prompts, load_prompts
from slime_hydra.data.source import PromptSource
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.rollout.client import EngineError, EngineUnavailable, SGLangClient
from slime_hydra.rollout.generate import RolloutContext, get_generate_fn, sampling_params
from slime_hydra.rollout.router import Router, RouterError
from slime_hydra.weight_sync import buckets

WEIGHT_GROUP = "weight_update_group"
UNHEALTHY_CHECKS = 3
"""Failed ``GET /health`` answers in a row after which a live engine process counts as dead and is restarted."""
HEALTH_TIMEOUT_S = 5.0
"""Seconds one health answer may take."""
RETRY_BACKOFF_S = 0.5
"""First pause before a /generate retry; doubled on each further retry."""
REPLAY_BUCKET_BYTES = 256 * 2**20
"""Largest request when replaying kept tensors into a restarted engine."""
ROUTER_STATUS_RETRIED = (502, 503, 504)
"""Router answers meaning it could not reach a worker (or has none healthy): the request is retried."""


class EngineFailure(RuntimeError):
    """Generation could not reach any engine after every retry (the message names the engines that were down)."""


@dataclass
class EvalSet:
    name: str
    dataset: PromptDataset
    n_samples_per_prompt: int
    params: dict


@dataclass
class WeightSource:
    """What the newest completed weight sync was, so that a restarted engine can be given it again."""

    kind: str
    """initial (no sync yet) | disk | tensor | broadcast (distributed or CUDA IPC: not replayable here)."""
    version: int = 0
    """The weight version the sync set."""
    path: Optional[str] = None
    """disk: the exported HF checkpoint directory."""


class RolloutManager:
    def __init__(self, cfg: SlimeConfig, model_path: str, run_dir: str, engines: list):
        """cfg: the whole config (the manager reads rollout, data, reward, algo); engines: EngineActor handles
        (already placed)."""
        from slime_hydra.reward import RewardScorer

        self.cfg, self.rollout = cfg, cfg.rollout
        self.run_dir = Path(run_dir)
        self.tokenizer = load_tokenizer(model_path)
        dataset = load_prompts(cfg.data, self.tokenizer)
        print(f"rollout: {dataset.stats.summary()}", flush=True)
        self.source = PromptSource(dataset.records, cfg.rollout.batch_prompts, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed)
        dynamic = get_filter(cfg.algo.dynamic_filter, cfg.reward.reward_key)
        self.buffer = RolloutBuffer(
            cfg.rollout.n_samples_per_prompt, [dynamic] if dynamic else [], max_attempts=cfg.rollout.max_filter_attempts,
            max_staleness=cfg.max_staleness if cfg.mode == "async" else None,
            recycle_aborted=cfg.rollout.partial_rollout)
        self.reward = RewardScorer(cfg.reward)
        self.generate_fn = get_generate_fn(cfg.rollout.generate)
        self.eval_sets = [self._eval_set(e) for e in cfg.data.eval]
        self.engines = list(engines)
        self.engine_urls: list[str] = []
        self.router = Router(policy=cfg.rollout.router_policy, log_path=self.run_dir / "logs" / "router.log")
        self.max_context = cfg.model.max_position_embeddings
        self._paused = False
        self._down: dict[int, str] = {}
        """Engines out of service (index -> why), from the moment a check finds them dead until they are back."""
        self._awaiting_weights: set[int] = set()
        """Restarted engines that wait for the next sync (the newest weights could not be replayed)."""
        self._restarts: dict[int, asyncio.Task] = {}
        self._unhealthy_checks: dict[int, int] = {}
        self._check_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        self._sync_holds_lock = False
        self._weights = WeightSource("initial")
        self._incoming: Optional[WeightSource] = None
        self._tensors: dict = {}
        self._group_stale = False
        self._monitor: Optional[asyncio.Task] = None
        self.counts = {"engine_restarts": 0, "generate_retries": 0}
        """Totals since start (a restart counts when the engine is found dead)."""
        self._reported = dict(self.counts)

    def _eval_set(self, e) -> EvalSet:
        dataset = load_eval_prompts(e, self.cfg.data, self.tokenizer)
        budget = e.max_response_tokens or self.rollout.max_response_tokens
        params = sampling_params(self.rollout, temperature=e.temperature, max_new_tokens=budget)
        if e.temperature == 0:
            params.update(top_p=1.0, top_k=-1)
        return EvalSet(e.name, dataset, e.n_samples_per_prompt, params)

    # ---- engines -------------------------------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Start the router and every engine, register the engines, wait until the router sees them healthy."""
        self.router.start()
        self.engine_urls = list(await asyncio.gather(*[e.start.remote() for e in self.engines]))
        for url in self.engine_urls:
            self.router.add_worker(url)
        await asyncio.to_thread(self.router.wait_ready, len(self.engine_urls), 120.0)
        self.client = SGLangClient(self.router.url)
        self.engine_clients = [SGLangClient(url) for url in self.engine_urls]
        concurrency = self.rollout.max_concurrency_per_engine * len(self.engine_urls)
        self.slots = asyncio.Semaphore(concurrency)
        self.ctx = RolloutContext(self.rollout, self.client, self.tokenizer, self.max_context)
        if self.rollout.health_check_interval_s > 0:
            self._monitor = asyncio.ensure_future(self._watch_engines())
        return self.engine_urls

    def num_engines(self) -> int:
        return len(self.engines)

    async def _on_engines(self, method: str, *args, **kwargs) -> list:
        """Call every engine in service (engines being restarted are skipped; see the module docstring)."""
        return list(await asyncio.gather(*[getattr(self.engine_clients[i], method)(*args, **kwargs)
                                           for i in range(len(self.engine_clients)) if i not in self._down]))

    async def _on_weight_receivers(self, method: str, *args, **kwargs) -> list:
        """Call every engine a weight sync reaches: those in service and restarted ones waiting for weights."""
        targets = [i for i in range(len(self.engine_clients)) if i not in self._down or i in self._awaiting_weights]
        return list(await asyncio.gather(*[getattr(self.engine_clients[i], method)(*args, **kwargs)
                                           for i in targets]))

    # ---- fault tolerance -----------------------------------------------------------------------------------------
    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(self.rollout.health_check_interval_s)
            await self.check_engines()

    async def check_engines(self) -> list[int]:
        """Check every engine in service once (process alive, GET /health); start the restart of each dead one and
        return their indices. Concurrent callers share one check."""
        if self._check_lock.locked():
            async with self._check_lock:
                return []
        async with self._check_lock:
            dead = []
            for i, (actor, client) in enumerate(zip(self.engines, self.engine_clients)):
                if i in self._down:
                    continue
                if not await actor.alive.remote():
                    cause = f"its process (pid {await actor.pid.remote()}) exited"
                elif await client.health(timeout_s=HEALTH_TIMEOUT_S):
                    self._unhealthy_checks[i] = 0
                    continue
                else:
                    self._unhealthy_checks[i] = self._unhealthy_checks.get(i, 0) + 1
                    if self._unhealthy_checks[i] < UNHEALTHY_CHECKS:
                        continue
                    cause = f"GET /health failed {UNHEALTHY_CHECKS} checks in a row"
                await self._take_out(i, cause)
                self._restarts[i] = asyncio.ensure_future(self._restart(i))
                dead.append(i)
            return dead

    async def _take_out(self, i: int, cause: str) -> None:
        """Mark engine i down and remove it from the router, so no new request reaches it."""
        url = self.engine_urls[i]
        self._down[i] = cause
        self._unhealthy_checks[i] = 0
        self.counts["engine_restarts"] += 1
        print(f"rollout: engine {i} ({url}) is down: {cause}; restarting it (log engine_{i}.log)", flush=True)
        try:
            await asyncio.to_thread(self.router.remove_worker, url)
        except RouterError as error:  # the router may have dropped it already; the restart goes on either way
            print(f"rollout: removing engine {i} from the router: {error}", flush=True)

    async def _restart(self, i: int) -> None:
        """Restart engine i on its port, give it the newest weights, put it back in the router."""
        url, cause = self.engine_urls[i], self._down[i]
        try:
            new_url = await self.engines[i].restart.remote()
            if new_url != url:
                raise RuntimeError(f"restarted at {new_url}, not on its old address {url}")
            async with self._weights_lock:
                if not await self._replay_weights(i):
                    self._awaiting_weights.add(i)
                    self._down[i] = f"restarted after: {cause}; waits for the next weight sync"
                    self._group_stale = True
                    return
                await self._register(i)
            print(f"rollout: engine {i} ({url}) is back at weight version {self._weights.version}", flush=True)
        except Exception as error:
            self._down[i] = f"{cause}; the restart failed: {type(error).__name__}: {error}"
            print(f"rollout: engine {i} ({url}) {self._down[i]}", flush=True)

    async def _replay_weights(self, i: int) -> bool:
        """Give restarted engine i the newest synced weights; False when they cannot be replayed from here."""
        source, client = self._weights, self.engine_clients[i]
        version = str(source.version)
        if source.kind == "disk":
            await client.update_weights_from_disk(source.path, weight_version=version)
        elif source.kind == "tensor":
            chunks = list(buckets(iter(self._tensors.items()), REPLAY_BUCKET_BYTES))
            for k, chunk in enumerate(chunks):
                await client.update_weights_from_tensor(dict(chunk), weight_version=version if k == len(chunks) - 1
                                                        else None, flush_cache=False)
        elif source.kind == "broadcast":
            return False
        await client.flush_cache()
        got = await client.get_weight_version()
        if got != version:
            raise RuntimeError(f"engine {i} reports weight version {got} after the replay of version {version}")
        return True

    async def _register(self, i: int) -> None:
        """Add engine i back to the router and wait until the router lists it healthy."""
        url = self.engine_urls[i]

        await asyncio.to_thread(self.router.add_worker, url)
        await asyncio.to_thread(self.router.wait_worker_healthy, url, 120.0)
        self._down.pop(i, None)
        self._awaiting_weights.discard(i)

    async def engine_status(self) -> list[dict]:
        """Per engine: index, url, up (in service), cause (why it is down, else None), in_router and
        router_healthy (as the router lists it)."""
        workers = {w.get("url"): w for w in await asyncio.to_thread(self.router.workers)}
        return [{"index": i, "url": url, "up": i not in self._down, "cause": self._down.get(i),
                 "in_router": url in workers, "router_healthy": bool(workers.get(url, {}).get("is_healthy"))}
                for i, url in enumerate(self.engine_urls)]

    async def wait_engines_settled(self, timeout_s: float = 300.0) -> None:
        """Wait until no restart is in progress."""
        running = [t for t in self._restarts.values() if not t.done()]
        if running:
            await asyncio.wait_for(asyncio.gather(*running), timeout_s)

    def weight_group_stale(self) -> bool:
        """True when an engine was restarted since the distributed weight group was formed: the trainer must form
        it again (``init_weight_sync``) before the next broadcast."""
        return self._group_stale

    def _down_report(self) -> str:
        if not self._down:
            return "every engine passed its last health check"
        return "; ".join(f"engine {i} ({self.engine_urls[i]}): {cause}" for i, cause in sorted(self._down.items()))

    # ---- generation ----------------------------------------------------------------------------------------------
    async def _generate_sample(self, sample: Sample, params: dict,
                               abort: Optional[asyncio.Event] = None) -> list[Sample]:
        """Run the generate function on one sample, retrying calls that could not reach an engine (see the module
        docstring); a sample still waiting for a slot when ``abort`` is set comes back aborted, unsent."""
        async with self.slots:
            for attempt in range(self.rollout.max_generate_retries + 1):
                if abort is not None and abort.is_set():
                    sample.status = Status.ABORTED
                    return [sample]
                before = copy.deepcopy(sample)
                try:
                    out = await self.generate_fn(self.ctx, sample, dict(params))
                    return out if isinstance(out, list) else [out]
                except Exception as error:
                    if not _unreachable(error):  # one bad sample must not end the rollout: it is marked and dropped
                        sample.status = Status.FAILED
                        sample.metadata["error"] = f"{type(error).__name__}: {error}"
                        return [sample]
                    last_error, sample = error, before
                await self.check_engines()  # a dead engine leaves the router (and the error names it)
                if attempt < self.rollout.max_generate_retries:
                    self.counts["generate_retries"] += 1
                    await self._await_an_engine()
                    await asyncio.sleep(RETRY_BACKOFF_S * 2 ** attempt)
        raise EngineFailure(
            f"sample {sample.index} (group {sample.group_index}): /generate through the router {self.router.url} "
            f"could not reach an engine in {self.rollout.max_generate_retries + 1} attempts "
            f"(rollout.max_generate_retries={self.rollout.max_generate_retries}); last error: {last_error}. "
            f"Engines: {self._down_report()}. Engine logs: engine_<i>.log; router log: {self.router.process.log_path}")

    async def _await_an_engine(self, timeout_s: float = 300.0) -> None:
        """When every engine is down, wait (up to ``timeout_s``) until a restart has brought one back."""
        deadline = time.monotonic() + timeout_s
        while len(self._down) == len(self.engines) and time.monotonic() < deadline:
            running = [t for t in self._restarts.values() if not t.done()]
            if not running:
                return
            await asyncio.wait(running, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)

    async def _generate_group(self, group: list[Sample], params: dict,
                              abort: Optional[asyncio.Event] = None) -> list[Sample]:
        """Generate the group's pending samples, then score it if every sample finished."""
        todo = [s for s in group if s.status is Status.PENDING]
        done = [s for s in group if s.status is not Status.PENDING]
        results = await asyncio.gather(*[self._generate_sample(s, params, abort) for s in todo])
        samples = sorted(done + [x for r in results for x in r], key=lambda s: s.index)
        if all(s.is_done for s in samples):
            rewards = await self.reward.score_group([s.response for s in samples], [s.label for s in samples],
                                                    [s.metadata for s in samples])
            for s, r in zip(samples, rewards):
                s.reward = r
        return samples

    async def generate_batch(self) -> dict:
        """One training batch of rollout.batch_prompts groups; returns {"samples": [dict], "metrics": {...}}."""
        start = time.monotonic()
        batch_prompts = self.rollout.batch_prompts
        params = sampling_params(self.rollout)
        aborted = 0
        while (req := self.buffer.request(batch_prompts, self.rollout.over_sampling_batch_prompts)) is not None:
            groups = req.resume + self.buffer.new_groups(self.source.take(req.new_prompts))
            abort = asyncio.Event()
            tasks = [asyncio.ensure_future(self._generate_group(g, params, abort)) for g in groups]
            try:
                for next_done in asyncio.as_completed(tasks):
                    self.buffer.add_group(await next_done)
                    if self.buffer.enough(batch_prompts) and not abort.is_set() and not all(t.done() for t in tasks):
                        aborted += 1
                        abort.set()
                        await self._abort_engines()
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
        batch = self.buffer.take_batch(batch_prompts)
        samples = batch.samples
        metrics = self._rollout_metrics(samples)
        metrics.update({f"rollout/buffer/{k}": float(v) for k, v in batch.counts.items()})
        metrics["rollout/aborts"] = float(aborted)
        # what happened since the previous batch's report (a restart may begin or end between batches)
        metrics.update({f"rollout/{k}": float(v - self._reported[k]) for k, v in self.counts.items()})
        self._reported = dict(self.counts)
        metrics["perf/rollout_time"] = time.monotonic() - start
        return {"samples": [s.to_dict() for s in samples], "metrics": metrics}

    async def _abort_engines(self) -> None:
        """/abort_request abort_all on every engine in service (one that died meanwhile is left to the checks)."""
        results = await asyncio.gather(*[self.engine_clients[i].abort(abort_all=True)
                                         for i in range(len(self.engine_clients)) if i not in self._down],
                                       return_exceptions=True)
        for error in results:
            if isinstance(error, BaseException) and not _unreachable(error):
                raise error

    def _rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        rewards = [s.scalar_reward(self.cfg.reward.reward_key) for s in samples]
        lengths = [s.response_length for s in samples]
        return {
            "rollout/raw_reward": statistics.fmean(rewards),
            "rollout/accuracy": statistics.fmean(float(_correct(s, self.cfg.reward.reward_key)) for s in samples),
            "rollout/response_len/mean": statistics.fmean(lengths),
            "rollout/response_len/max": float(max(lengths)),
            "rollout/truncated_ratio": statistics.fmean(float(s.status is Status.TRUNCATED) for s in samples),
            "rollout/tokens": float(sum(lengths)),
        }

    # ---- evaluation ----------------------------------------------------------------------------------------------
    async def evaluate(self) -> dict[str, float]:
        """Metrics of every eval set (see the module docstring)."""
        start = time.monotonic()
        metrics: dict[str, float] = {}
        for ev in self.eval_sets:
            n = ev.n_samples_per_prompt
            groups = [[Sample(index=i * n + j, group_index=i, prompt=r.prompt, label=r.label,
                              metadata=dict(r.metadata), tokens=list(r.token_ids)) for j in range(n)]
                      for i, r in enumerate(ev.dataset.records)]
            done = await asyncio.gather(*[self._generate_group(g, ev.params) for g in groups])
            key = self.cfg.reward.reward_key
            correct = [[_correct(s, key) for s in g] for g in done]
            flat = [s for g in done for s in g]
            metrics[f"eval/{ev.name}/accuracy"] = statistics.fmean(float(c) for g in correct for c in g)
            metrics[f"eval/{ev.name}/reward"] = statistics.fmean(s.scalar_reward(key) for s in flat)
            metrics[f"eval/{ev.name}/response_len"] = statistics.fmean(s.response_length for s in flat)
            k = 1
            while k <= n:
                metrics[f"eval/{ev.name}/pass@{k}"] = statistics.fmean(pass_at_k(n, sum(g), k) for g in correct)
                k *= 2
        metrics["perf/eval_time"] = time.monotonic() - start
        return metrics

    # ---- weights -------------------------------------------------------------------------------------------------
    async def begin_weight_update(self) -> None:
        """Hold generation in place (async mode: a rollout may be running) so updates apply at once."""
        await self._weights_lock.acquire()  # held until finish_weight_update: no replay into a restart meanwhile
        self._sync_holds_lock = True
        await self._on_engines("pause_generation", mode="in_place")
        self._paused = True

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._on_weight_receivers("update_weights_from_disk", path, weight_version=str(version))
        self._incoming = WeightSource("disk", version, str(path))

    async def init_weight_sync(self, master_address: str, master_port: int, backend: str) -> None:
        """Join every engine to the broadcast group whose rank 0 is the trainer (engine i is rank 1 + i)."""
        world = 1 + len(self.engine_clients)
        if self._group_stale:  # an engine restarted: the survivors leave the old group (the restarted one has none)
            for client in self.engine_clients:
                try:
                    await client.destroy_weights_update_group(WEIGHT_GROUP)
                except EngineError:
                    pass
        self._group_stale = False
        await asyncio.gather(*[
            c.init_weights_update_group(master_address, master_port, 1 + i, world, WEIGHT_GROUP, backend=backend)
            for i, c in enumerate(self.engine_clients)])

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: Optional[int]) -> None:
        """Receive one broadcast bucket; the last bucket of a sync carries the new version."""
        self._incoming = WeightSource("broadcast")
        await self._on_weight_receivers("update_weights_from_distributed", names, dtypes, shapes, WEIGHT_GROUP,
                                        weight_version=None if version is None else str(version), flush_cache=False)

    async def update_weights_from_tensor(self, named: dict, version: Optional[int]) -> None:
        """Load one bucket of tensors sent through Ray; the last bucket of a sync carries the new version."""
        self._tensors.update(named)  # kept for restarted engines (the module docstring)
        self._incoming = WeightSource("tensor")
        await self._on_weight_receivers("update_weights_from_tensor", named,
                                        weight_version=None if version is None else str(version), flush_cache=False)

    async def update_weights_from_cuda_ipc(self, handles: list[dict], version: Optional[int]) -> None:
        """Colocated GPUs: every engine copies one bucket from the trainer's GPU memory (the handle of its GPU)."""
        self._incoming = WeightSource("broadcast")
        await self._on_weight_receivers("update_weights_from_cuda_ipc", handles,
                                        weight_version=None if version is None else str(version), flush_cache=False)

    async def finish_weight_update(self, version: int) -> int:
        """Flush the engines' caches, resume generation, make ``version`` current in the buffer; returns the
        groups dropped as stale. Restarted engines this sync reached go back into the router."""
        await self._on_weight_receivers("flush_cache")
        if self._paused:
            await self._on_engines("continue_generation")
            self._paused = False
        if self._incoming is not None:
            self._weights = WeightSource(self._incoming.kind, version, self._incoming.path)
            self._incoming = None
            if self._weights.kind != "tensor":
                self._tensors = {}
            for i in sorted(self._awaiting_weights):
                await self._register(i)
        if self._sync_holds_lock:
            self._sync_holds_lock = False
            self._weights_lock.release()
        return self.buffer.set_weight_version(version)

    async def release_memory(self) -> None:
        """Colocated GPUs: every engine parks its weights on the host so the trainer can use the GPU memory."""
        await self._on_engines("release_memory_occupation")

    async def resume_memory(self) -> None:
        await self._on_engines("resume_memory_occupation")

    async def engine_weight_versions(self) -> list[str]:
        return await self._on_engines("get_weight_version")

    # ---- checkpoint, shutdown ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer.load_state_dict(state["buffer"])

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for task in self._restarts.values():
            task.cancel()
        for c in getattr(self, "engine_clients", []) + ([self.client] if hasattr(self, "client") else []):
            await c.close()
        await asyncio.gather(*[e.stop.remote() for e in self.engines])
        self.router.stop()


def _unreachable(error: BaseException) -> bool:
    """The call never got an engine's answer: nothing listened, or the router could not reach a worker."""
    return isinstance(error, EngineUnavailable) or (
        isinstance(error, EngineError) and error.status in ROUTER_STATUS_RETRIED)


def _correct(sample: Sample, reward_key: Optional[str]) -> bool:
    """The reward says correct: a dict's ``acc`` when present, else scalar reward >= 1."""
    if isinstance(sample.reward, dict) and "acc" in sample.reward:
        return bool(sample.reward["acc"])
    return sample.scalar_reward(reward_key) >= 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct among n samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
