"""``RolloutManager``: prompts in, scored and filtered training groups out (the Ray actor the loop talks to).

It owns the prompt source, the buffer, the reward and the eval sets, and generates through the router; the engines
are kept in service by its ``EnginePool`` (engine_pool.py: health, restarts, router membership) and receive the
trainer's weights through its ``WeightRelay`` (weight_relay.py), whose calls the actor forwards (Ray reaches an
actor's own methods only). One training batch::

    batch = await manager.generate_batch()     # {"samples": [...], "metrics": {...}}

runs the buffer's rounds (buffer/buffer.py): each round starts every group it was given (recycled ones first), each
group's samples generate concurrently through the router (at most ``max_concurrency_per_engine`` requests in flight
per engine in service: engine_pool.InFlightLimit), a group is scored as soon as all its samples are back, then
handed to the buffer (filters, staleness). Once the buffer holds ``batch_prompts`` kept groups, the rest of the
round is aborted on every engine (``/abort_request``; sglang-router does not forward it, so engines are called
directly): their partial samples come back aborted and the buffer recycles them (``rollout.partial_rollout``) or
drops them. A round whose groups are all done while samples still wait for a concurrency slot never sends those:
once the abort is decided they come back aborted without a request.
Under ``algo.objective=sft`` a batch is the data's next rows with their responses instead (rollout/sft.py): no
engine, no reward; the engines serve the evals only.

Retries. A ``/generate`` that cannot reach an engine (connection error, router 502/503/504) is retried through the
router up to ``rollout.max_generate_retries`` times (``net.backoff_s`` from 0.5 s; a health check runs first, so a
dead engine is out of the router by then). Each retry starts the sample again from its state before the failed call
(a copy taken before every call), so no sample keeps tokens of an engine's lost partial state; the only tokens a
sample carries across engines are those of a recycled partial rollout, which is what ``rollout.partial_rollout``
means. After the last retry the rollout stops with an error that names the engines that were down and why.
Counted in ``rollout/engine_restarts`` and ``rollout/generate_retries``.

Failures that are not the engines'. A generate function that raises on a sample marks it FAILED with the error
text and the buffer drops its group: counted in ``rollout/failed_samples``, the first error of the batch printed;
a rollout round in which every group failed stops the run (``RolloutFailure``, with the first error). A reward
call past ``reward.timeout_s`` scores 0, counted in ``rollout/reward_timeouts``.

Heap. Once started the actor freezes its heap (``heap.freeze``: torch, Ray, the tokenizer and the prompt set are
never walked by the garbage collector again); ``perf/rollout_gc_time`` is the seconds its collections took since
the previous batch.

Evaluation (``evaluate``): every ``data.eval`` set with its own samples per prompt, temperature and response
budget; metrics ``eval/<name>/accuracy`` (fraction of samples whose reward says correct: the dict's ``acc`` when
there is one, else scalar reward >= 1; a sample whose generation failed, or that a failed sample left unscored in
its group, counts as wrong with reward 0, in ``eval/<name>/failed_samples``, the first error printed), ``eval/<name>/reward``, ``eval/<name>/response_len`` and, for k in
1, 2, 4 ... <= n, ``eval/<name>/pass@k`` with the unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over
prompts (c correct of n samples).

Adaptive difficulty (``data.adaptive.enabled``): the prompt source is an ``AdaptiveSampler`` (data/adaptive.py)
instead of a dataset's ``PromptSource``; every scored group of a batch is reported to it at the end of the batch
(task, level, fraction of samples correct), which moves the levels and gives the ``env/<task>/...`` metrics. Eval
sets of an environment span its levels and add ``eval/<name>/level_<L>/accuracy``.

Checkpoint: ``state_dict()`` is JSON-safe: the prompt cursor (or the adaptive sampler's state) and the buffer.

The run's API key (rollout/auth.py) is made here, once, and written to ``<run_dir>/api_key``: the router and every
engine require it, and every client of theirs sends it.

``cfg`` is the run's SlimeConfig; the manager reads its rollout, data, reward, algo.dynamic_filter, mode,
max_staleness and model.max_position_embeddings slices.
"""

import asyncio
import copy
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slime_hydra import heap
from slime_hydra.buffer.buffer import RolloutBuffer
from slime_hydra.buffer.filters import get_filter
from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.data.adaptive import AdaptiveSampler, GroupResult
from slime_hydra.data.dataset import PromptDataset, load_eval_prompts, load_prompt_rows, load_prompts
from slime_hydra.data.source import PromptSource
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.net import backoff_s
from slime_hydra.reward import RewardScorer
from slime_hydra.rollout.auth import API_KEY_FILE, new_api_key, write_private
from slime_hydra.rollout.client import MEMORY_TAGS, EngineError, EngineUnavailable, SGLangClient
from slime_hydra.rollout.elastic import NodeWatcher
from slime_hydra.rollout.engine_pool import DRAIN_TIMEOUT_S, EnginePool, InFlightLimit
from slime_hydra.rollout.engines.process import last_traceback
from slime_hydra.rollout.generate import RolloutContext, get_generate_fn, request_seed, sampling_params
from slime_hydra.rollout.router import Router, RouterError
from slime_hydra.rollout.sample_metrics import hook_counters, is_correct, reward_extras
from slime_hydra.rollout.sft import sft_batch
from slime_hydra.rollout.weight_relay import WeightRelay
from slime_hydra.stall import InFlight

RETRY_BACKOFF_S = 0.5
"""First pause before a /generate retry; doubled on each further retry (net.backoff_s)."""
ROUTER_STATUS_RETRIED = (502, 503, 504)
"""Router answers meaning it could not reach a worker (or has none healthy): the request is retried."""


class EngineFailure(RuntimeError):
    """Generation could not reach any engine after every retry (the message names the engines that were down)."""


class RolloutFailure(RuntimeError):
    """Every group of a rollout round failed (the message carries the first error): the run cannot make progress."""


@dataclass
class EvalSet:
    name: str
    dataset: PromptDataset
    n_samples_per_prompt: int
    params: dict


class RolloutManager:
    def __init__(self, cfg, model_path: str, run_dir: str, engines: list, engine_spec=None):
        """cfg: the whole config (the slices the module docstring names); engines: EngineActor handles (placed);
        engine_spec: how they were made (engines/actor.EngineSpec), for engines added while the run goes on."""
        self.cfg, self.rollout = cfg, cfg.rollout
        self.engine_spec = engine_spec
        self.run_dir = Path(run_dir)
        self.tokenizer = load_tokenizer(model_path)
        self.adaptive = cfg.data.adaptive.enabled
        if self.adaptive:
            self.source = AdaptiveSampler(cfg.data.adaptive, cfg.data.task, cfg.data.seed, self._records)
            print(f"rollout: prompts generated at adaptive levels {self.source.state_dict()['levels']}", flush=True)
        else:
            data = cfg.algo.from_data  # sft, dpo: its rows come with their responses (rollout/sft.py)
            dataset = load_prompts(cfg.data, self.tokenizer, cfg.rollout.max_response_tokens if data else None,
                                   cfg.algo.pairs)
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
        self.api_key = new_api_key()
        write_private(self.run_dir / API_KEY_FILE, self.api_key)
        self.router = Router(policy=cfg.rollout.router_policy, log_path=self.run_dir / "logs" / "router.log",
                             api_key=self.api_key)
        self.pool = EnginePool(engines, self.router, cfg.rollout.health_check_interval_s, self.api_key,
                               elastic=cfg.rollout.elastic)
        self.engine_gpus = self.rollout.gpus_per_engine if cfg.cluster.gpus_per_node > 0 else 0  # an added one's
        elastic = cfg.rollout.elastic and engine_spec is not None
        self.node_watcher = NodeWatcher(self.pool, engine_spec, self.engine_gpus) if elastic else None
        """rollout.elastic: engines for the nodes that join (rollout/elastic.py)."""
        self.released: set[str] = set()
        """The MEMORY_TAGS the engines have given back (release_memory) and not resumed yet."""
        self.weights = WeightRelay(self.pool, self.buffer.set_weight_version, self._use_adapter)
        self.max_context = cfg.model.max_position_embeddings
        self.generate_retries = 0
        """/generate calls retried since start."""
        self.failed_samples = 0
        """Samples whose generate function raised (their groups are dropped) since start."""
        self._reported: dict[str, float] = {}
        self.in_flight = InFlight()
        """Generations and reward groups in flight, for the stall doctor (stall_probe)."""
        self.batch_turn = asyncio.Condition()
        """Held while a batch is made: each draws its prompts and takes its groups from the buffer in turn."""
        self.batches_made: Optional[int] = 0
        """Training batches made since the run started (checkpointed): the step index of the next one."""
        self.gc_times = heap.GcTimes()
        """This actor's garbage collections (``perf/rollout_gc_time``; its heap is frozen once started)."""

    def _records(self, rows: list[dict]) -> list:
        """Generated rows as tokenized records (the adaptive sampler's)."""
        d = self.cfg.data
        return load_prompt_rows(rows, self.tokenizer, source="adaptive", metadata_key="metadata",
                                apply_chat_template=d.apply_chat_template, max_prompt_tokens=d.max_prompt_tokens).records

    def _eval_set(self, e) -> EvalSet:
        sft = self.cfg.algo.objective == "sft"  # with the responses of the held-out loss (``held_out``)
        dataset = load_eval_prompts(e, self.cfg.data, self.tokenizer, self.rollout.max_response_tokens if sft else None)
        budget = e.max_response_tokens or self.rollout.max_response_tokens
        params = sampling_params(self.rollout, temperature=e.temperature, max_new_tokens=budget)
        if e.temperature == 0:
            params.update(top_p=1.0, top_k=-1)
        return EvalSet(e.name, dataset, e.n_samples_per_prompt, params)

    async def start(self) -> list[str]:
        """Start the router and the engines (EnginePool.start); returns the engine URLs."""
        urls = await self.pool.start()
        if self.node_watcher is not None:
            await self.node_watcher.start()
        self.client = SGLangClient(self.router.url, api_key=self.api_key)
        self.slots = InFlightLimit(self.rollout.max_concurrency_per_engine,
                                   lambda: self.pool.kept)
        self.ctx = RolloutContext(self.rollout, self.client, self.tokenizer, self.max_context)
        heap.freeze()  # this actor's process is the rollout manager alone
        self.gc_times.start()
        return urls

    # ---- generation ----------------------------------------------------------------------------------------------
    async def _generate_sample(self, sample: Sample, params: dict,
                               abort: Optional[asyncio.Event] = None) -> list[Sample]:
        """Run the generate function on one sample, retrying calls that could not reach an engine (see the module
        docstring); a sample still waiting for a slot when ``abort`` is set comes back aborted, unsent."""
        first_error = None
        async with self.slots:
            for attempt in range(self.rollout.max_generate_retries + 1):
                if abort is not None and abort.is_set():
                    sample.status = Status.ABORTED
                    return [sample]
                before = copy.deepcopy(sample)
                try:
                    with self.in_flight.call("generation"):
                        out = await self.generate_fn(self.ctx, sample, dict(params))
                    return out if isinstance(out, list) else [out]
                except Exception as error:
                    if not _unreachable(error):  # one bad sample must not end the rollout: it is marked and dropped
                        sample.status = Status.FAILED
                        sample.metadata["error"] = f"{type(error).__name__}: {error}"
                        return [sample]
                    last_error, sample = error, before
                    first_error = first_error or last_error
                if not self.router.process.alive:  # no retry can help: stop, naming it
                    raise RouterError(f"the router (pid {self.router.process.pid}) exited with code "
                                      f"{self.router.process.popen.returncode}; last lines of its log "
                                      f"{self.router.process.log_path}:\n{self.router.process.log_tail(2000)}")
                await self.pool.check()  # a dead engine leaves the router (and the error names it)
                self.pool.raise_if_failed()  # an engine's actor is gone: that, not the retries, stops the run
                if attempt < self.rollout.max_generate_retries:
                    self.generate_retries += 1
                    await self.pool.await_an_engine()
                    await asyncio.sleep(backoff_s(attempt, RETRY_BACKOFF_S))
        raise EngineFailure(
            f"sample {sample.index} (group {sample.group_index}): /generate through the router {self.router.url} "
            f"could not reach an engine in {self.rollout.max_generate_retries + 1} attempts "
            f"(rollout.max_generate_retries={self.rollout.max_generate_retries}); first error: {first_error}; "
            f"last error: {last_error}. Engines: {self.pool.down_report()}. Engine logs: engine_<i>.log; router "
            f"log: {self.router.process.log_path}{self._engine_tracebacks()}")

    def _engine_tracebacks(self) -> str:
        """Each engine log's last traceback: an engine that failed requests, or died, says why there."""
        logs = sorted((self.run_dir / "logs").glob("engine_*.log"))
        return "".join(f"\n{log.name}, its last traceback:\n{tail}" for log in logs if (tail := last_traceback(log)))

    async def _generate_group(self, group: list[Sample], params: dict, abort: Optional[asyncio.Event] = None,
                              stream: str = "train") -> list[Sample]:
        """Generate the group's pending samples, then score it if every sample finished. stream: what the samples
        are for (``train`` or ``eval/<name>``), a part of each request's seed under deterministic=true."""
        todo = [s for s in group if s.status is Status.PENDING]
        done = [s for s in group if s.status is not Status.PENDING]
        if self.cfg.deterministic:  # a stream of draws per request: what shares an engine's batch changes nothing
            seeded = [{**params, "sampling_seed": request_seed(self.cfg.seed, stream, s.group_index, s.index,
                                                               self.buffer.weight_version)} for s in todo]
        else:
            seeded = [params] * len(todo)
        results = await asyncio.gather(*[self._generate_sample(s, p, abort) for s, p in zip(todo, seeded)])
        samples = sorted(done + [x for r in results for x in r], key=lambda s: s.index)
        if all(s.is_done for s in samples):
            with self.in_flight.call(f"reward group ({self.reward.name})"):
                rewards = await self.reward.score_group([s.response for s in samples], [s.label for s in samples],
                                                        [s.metadata for s in samples])
            for s, r in zip(samples, rewards):
                s.reward = r
        return samples

    async def generate_batch(self, step: Optional[int] = None) -> dict:
        """One training batch of rollout.batch_prompts groups; returns {"samples": [dict], "metrics": {...}}. Batches
        are made one at a time, in step order: ``step`` (0-based, None: whichever comes) waits until the batches of
        the steps before it are made (in async mode the loop asks up to max_staleness ahead, and Ray starts an
        async actor's calls in no fixed order)."""
        async with self.batch_turn:
            await self.batch_turn.wait_for(lambda: None in (step, self.batches_made) or step <= self.batches_made)
            try:
                return await self._generate_batch()
            finally:
                self.batches_made = None if self.batches_made is None else self.batches_made + 1
                self.batch_turn.notify_all()

    async def _generate_batch(self) -> dict:
        self.pool.raise_if_failed()
        if self.cfg.algo.from_data:  # sft, dpo: the data's responses, nothing to sample
            return sft_batch(self.source.take(self.rollout.batch_prompts), self.batches_made or 0)
        start, serving = time.monotonic(), self.pool.in_service
        batch_prompts = self.rollout.batch_prompts
        params = sampling_params(self.rollout)
        aborted, errors, results = 0, [], []
        while (req := self.buffer.request(batch_prompts, self.rollout.over_sampling_batch_prompts)) is not None:
            groups = req.resume + self.buffer.new_groups(self.source.take(req.new_prompts))
            abort = asyncio.Event()
            tasks = [asyncio.ensure_future(self._generate_group(g, params, abort)) for g in groups]
            failed_groups = 0
            try:
                for next_done in asyncio.as_completed(tasks):
                    group = await next_done
                    failed = [s.metadata.get("error", "?") for s in group if s.status is Status.FAILED]
                    errors += failed
                    failed_groups += bool(failed)
                    if self.adaptive and all(s.reward is not None for s in group):
                        results.append((group[0].group_index, GroupResult(
                            group[0].metadata["task"], group[0].metadata["level"],
                            statistics.fmean(float(is_correct(s, self.cfg.reward.reward_key)) for s in group))))
                    self.buffer.add_group(group)
                    if self.buffer.enough(batch_prompts) and not abort.is_set() and not all(t.done() for t in tasks):
                        aborted += 1
                        abort.set()
                        await self.pool.abort_all(_unreachable)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
            if groups and failed_groups == len(groups):
                raise RolloutFailure(f"every one of the {len(groups)} groups of a rollout round failed "
                                     f"({len(errors)} samples); the first error: {errors[0]}")
        if errors:
            self.failed_samples += len(errors)
            print(f"rollout: {len(errors)} samples failed in this batch (their groups were dropped); the first "
                  f"error: {errors[0]}", flush=True)
        batch = self.buffer.take_batch(batch_prompts, by_index=self.cfg.deterministic)
        samples = batch.samples
        metrics = self._rollout_metrics(samples)
        metrics.update({f"rollout/buffer/{k}": float(v) for k, v in batch.counts.items()})
        metrics["rollout/aborts"] = float(aborted)
        metrics["rollout/engines_in_service"] = float(serving)  # when the batch began (elastic engines change it)
        if self.adaptive:
            metrics.update(self.source.update([r for _, r in sorted(results, key=lambda x: x[0])]))
        # what happened since the previous batch's report (a restart may begin or end between batches)
        counts = {"rollout/engine_restarts": self.pool.restarts_total,
                  "rollout/generate_retries": self.generate_retries, "rollout/failed_samples": self.failed_samples,
                  "rollout/reward_timeouts": self.reward.timeouts, "perf/rollout_gc_time": sum(self.gc_times.seconds)}
        metrics.update({k: float(v - self._reported.get(k, 0)) for k, v in counts.items()})
        self._reported = counts
        metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / max(time.monotonic() - start, 1e-9)
        peaks = await self.pool.gpu_peaks()
        if peaks:  # GPU engines: the most they ever allocated (the memory plan's engine estimate)
            metrics["rollout/engine_gpu_peak_gb"] = max(peaks) / 2**30
        return {"samples": [s.to_dict() for s in samples], "metrics": metrics}

    def _rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        rewards = [s.scalar_reward(self.cfg.reward.reward_key) for s in samples]
        lengths = [s.response_length for s in samples]
        return {**reward_extras(samples, self.cfg.reward.reward_key), **hook_counters(samples),
            "rollout/raw_reward": statistics.fmean(rewards),
            "rollout/accuracy": statistics.fmean(float(is_correct(s, self.cfg.reward.reward_key)) for s in samples),
            "rollout/response_len/mean": statistics.fmean(lengths),
            "rollout/response_len/max": float(max(lengths)),
            "rollout/truncated_ratio": statistics.fmean(float(s.status is Status.TRUNCATED) for s in samples),
            "rollout/tokens": float(sum(lengths)),
        }

    # ---- evaluation ----------------------------------------------------------------------------------------------
    async def evaluate(self) -> dict[str, float]:
        """Metrics of every eval set (see the module docstring)."""
        self.pool.raise_if_failed()
        metrics: dict[str, float] = {}
        for ev in self.eval_sets:
            n = ev.n_samples_per_prompt
            groups = [[Sample(index=i * n + j, group_index=i, prompt=r.prompt, label=r.label,
                              metadata=dict(r.metadata), tokens=list(r.token_ids)) for j in range(n)]
                      for i, r in enumerate(ev.dataset.records)]
            done = await asyncio.gather(*[self._generate_group(g, ev.params, stream=f"eval/{ev.name}")
                                          for g in groups])
            key = self.cfg.reward.reward_key
            correct = [[s.reward is not None and is_correct(s, key) for s in g] for g in done]
            flat = [s for g in done for s in g]
            unscored = [s for s in flat if s.reward is None]  # a failed sample left its group unscored
            if unscored:
                errors = [s.metadata["error"] for s in unscored if "error" in s.metadata]
                print(f"eval {ev.name}: {len(unscored)} samples failed or left unscored, counted as wrong and "
                      f"reward 0; the first error: {errors[0] if errors else '-'}", flush=True)
            metrics[f"eval/{ev.name}/failed_samples"] = float(len(unscored))
            metrics[f"eval/{ev.name}/accuracy"] = statistics.fmean(float(c) for g in correct for c in g)
            metrics[f"eval/{ev.name}/reward"] = statistics.fmean(
                s.scalar_reward(key) if s.reward is not None else 0.0 for s in flat)
            metrics[f"eval/{ev.name}/response_len"] = statistics.fmean(s.response_length for s in flat)
            levels = sorted({g[0].metadata["level"] for g in done if "level" in g[0].metadata})
            for level in levels if len(levels) > 1 else []:
                metrics[f"eval/{ev.name}/level_{level}/accuracy"] = statistics.fmean(
                    float(c) for g, cs in zip(done, correct) if g[0].metadata.get("level") == level for c in cs)
            k = 1
            while k <= n:
                metrics[f"eval/{ev.name}/pass@{k}"] = statistics.fmean(pass_at_k(n, sum(g), k) for g in correct)
                k *= 2
        return metrics

    def held_out(self) -> dict[str, list[dict]]:
        """algo=sft: each eval set's rows with their responses, as samples (the trainer's held-out loss)."""
        return {e.name: sft_batch(e.dataset.records, 0)["samples"] for e in self.eval_sets}

    def stall_probe(self) -> tuple[int, str]:
        """For the stall doctor (stall.py): the count of finished generations and reward groups, and what is in
        flight now, with the engines out of service."""
        return self.in_flight.finished, f"{self.in_flight.describe()}; engines: {self.pool.down_report()}"

    # ---- weights (forwarded to the relay; weight_relay.py) --------------------------------------------------------
    def weight_group_size(self) -> int:
        return self.weights.group_size()

    async def begin_weight_update(self) -> None:
        self.pool.raise_if_failed()
        await self.weights.begin()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self.weights.from_disk(path, version)

    async def load_adapter_from_disk(self, path: str, version: int) -> None:
        await self.weights.from_adapter_dir(path, version)

    def _use_adapter(self, name: Optional[str]) -> None:
        self.client.lora_path = name

    async def init_weight_sync(self, master_address: str, master_port: int, backend: str) -> None:
        await self.weights.join_group(master_address, master_port, backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: Optional[int]) -> None:
        await self.weights.from_distributed(names, dtypes, shapes, version)

    async def update_weights_from_tensor(self, named: dict, version: Optional[int]) -> None:
        await self.weights.from_tensor(named, version)

    async def update_weights_from_cuda_ipc(self, handles: list[dict], version: Optional[int]) -> None:
        await self.weights.from_cuda_ipc(handles, version)

    async def finish_weight_update(self, version: int) -> int:
        return await self.weights.finish(version)

    async def abort_weight_update(self) -> list[int]:
        return await self.weights.abort()

    def needs_weights(self) -> bool:
        """No engine can generate until the trainer sends the current weights again (EnginePool.needs_weights)."""
        return self.pool.needs_weights()

    def weight_group_stale(self) -> bool:
        return self.pool.group_stale

    async def release_memory(self) -> None:
        """Colocated GPUs: every engine gives back its GPU memory (all of MEMORY_TAGS) so the trainer can use it."""
        await self.pool.on_engines("release_memory_occupation", list(MEMORY_TAGS))
        self.released = set(MEMORY_TAGS)

    async def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        """Take back what ``release_memory`` gave, of ``tags`` (None: all); tags not released are skipped (SGLang
        refuses to resume them)."""
        todo = [t for t in (tags or MEMORY_TAGS) if t in self.released]
        if todo:
            await self.pool.on_engines("resume_memory_occupation", todo)
            self.released -= set(todo)

    # ---- elastic engines -----------------------------------------------------------------------------------------
    async def add_engine(self) -> dict:
        """One more engine while the run goes on (EnginePool.add), wherever Ray finds its resources free (on GPUs:
        rollout.gpus_per_engine GPUs of one node, e.g. a node that joined). Returns its ``engine_status`` row."""
        if self.engine_spec is None:
            raise RuntimeError("this rollout manager was made without an engine spec: it cannot add engines")
        if self.cfg.cluster.colocate:
            raise ValueError("cluster.colocate=true: the engines share the trainer's GPUs, so none can be added")
        i = await self.pool.add(lambda index: self.engine_spec.make(index, self.engine_gpus))
        return (await self.pool.status())[i]

    async def remove_engine(self, index: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> dict:
        """Drain engine ``index`` and stop it (EnginePool.remove). Returns its ``engine_status`` row and
        ``retried``: the requests it still held after ``drain_timeout_s`` (retried on the other engines)."""
        held = await self.pool.remove(index, drain_timeout_s)
        return dict((await self.pool.status())[index], retried=held)

    async def engine_status(self) -> list[dict]:
        return await self.pool.status()

    # ---- checkpoint, shutdown ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "buffer": self.buffer.state_dict(), "batches": self.batches_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer.load_state_dict(state["buffer"])
        self.batches_made = state.get("batches")  # None (an older checkpoint): batches in the order calls come

    async def shutdown(self) -> None:
        if self.node_watcher is not None:
            self.node_watcher.stop()
        if hasattr(self, "client"):
            await self.client.close()
        await self.pool.shutdown()


def _unreachable(error: BaseException) -> bool:
    """The call never got an engine's answer: nothing listened, or the router could not reach a worker."""
    return isinstance(error, EngineUnavailable) or (
        isinstance(error, EngineError) and error.status in ROUTER_STATUS_RETRIED)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct among n samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
