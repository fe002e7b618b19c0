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
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.generate import RolloutContext, get_generate_fn, sampling_params
from slime_hydra.rollout.router import Router

WEIGHT_GROUP = "weight_update_group"


@dataclass
class EvalSet:
    name: str
    dataset: PromptDataset
    n_samples_per_prompt: int
    params: dict


class RolloutManager:
    def __init__(self, cfg: SlimeConfig, model_path: str, run_dir: str, engines: list, max_filter_rounds: int = 3):
        """cfg: the whole config (the manager reads rollout, data, reward, algo); engines: EngineActor handles
        (already placed); max_filter_rounds: buffer rounds before falling back to filtered-out groups."""
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
            cfg.rollout.n_samples_per_prompt, [dynamic] if dynamic else [], max_attempts=max_filter_rounds,
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
        return self.engine_urls

    def num_engines(self) -> int:
        return len(self.engines)

    async def _on_engines(self, method: str, *args, **kwargs) -> list:
        return list(await asyncio.gather(*[getattr(c, method)(*args, **kwargs) for c in self.engine_clients]))

    # ---- generation ----------------------------------------------------------------------------------------------
    async def _generate_sample(self, sample: Sample, params: dict) -> list[Sample]:
        async with self.slots:
            try:
                out = await self.generate_fn(self.ctx, sample, dict(params))
            except Exception as error:  # one bad sample must not end the rollout: it is marked and dropped
                sample.status = Status.FAILED
                sample.metadata["error"] = f"{type(error).__name__}: {error}"
                return [sample]
        return out if isinstance(out, list) else [out]

    async def _generate_group(self, group: list[Sample], params: dict) -> list[Sample]:
        """Generate the group's pending samples, then score it if every sample finished."""
        todo = [s for s in group if s.status is Status.PENDING]
        done = [s for s in group if s.status is not Status.PENDING]
        results = await asyncio.gather(*[self._generate_sample(s, params) for s in todo])
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
            tasks = [asyncio.ensure_future(self._generate_group(g, params)) for g in groups]
            for next_done in asyncio.as_completed(tasks):
                self.buffer.add_group(await next_done)
                if self.buffer.enough(batch_prompts) and not all(t.done() for t in tasks):
                    aborted += 1
                    await self._on_engines("abort", abort_all=True)
        batch = self.buffer.take_batch(batch_prompts)
        samples = batch.samples
        metrics = self._rollout_metrics(samples)
        metrics.update({f"rollout/buffer/{k}": float(v) for k, v in batch.counts.items()})
        metrics["rollout/aborts"] = float(aborted)
        metrics["perf/rollout_time"] = time.monotonic() - start
        return {"samples": [s.to_dict() for s in samples], "metrics": metrics}

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
        await self._on_engines("pause_generation", mode="in_place")
        self._paused = True

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._on_engines("update_weights_from_disk", path, weight_version=str(version))

    async def init_weight_sync(self, master_address: str, master_port: int, backend: str) -> None:
        """Join every engine to the broadcast group whose rank 0 is the trainer (engine i is rank 1 + i)."""
        world = 1 + len(self.engine_clients)
        await asyncio.gather(*[
            c.init_weights_update_group(master_address, master_port, 1 + i, world, WEIGHT_GROUP, backend=backend)
            for i, c in enumerate(self.engine_clients)])

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: Optional[int]) -> None:
        """Receive one broadcast bucket; the last bucket of a sync carries the new version."""
        await self._on_engines("update_weights_from_distributed", names, dtypes, shapes, WEIGHT_GROUP,
                               weight_version=None if version is None else str(version), flush_cache=False)

    async def update_weights_from_tensor(self, named: dict, version: Optional[int]) -> None:
        """Load one bucket of tensors sent through Ray; the last bucket of a sync carries the new version."""
        await self._on_engines("update_weights_from_tensor", named,
                               weight_version=None if version is None else str(version), flush_cache=False)

    async def finish_weight_update(self, version: int) -> int:
        """Flush the engines' caches, resume generation, make ``version`` current in the buffer; returns the
        groups dropped as stale."""
        await self._on_engines("flush_cache")
        if self._paused:
            await self._on_engines("continue_generation")
            self._paused = False
        return self.buffer.set_weight_version(version)

    async def engine_weight_versions(self) -> list[str]:
        return await self._on_engines("get_weight_version")

    # ---- checkpoint, shutdown ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer.load_state_dict(state["buffer"])

    async def shutdown(self) -> None:
        for c in getattr(self, "engine_clients", []) + ([self.client] if hasattr(self, "client") else []):
            await c.close()
        await asyncio.gather(*[e.stop.remote() for e in self.engines])
        self.router.stop()


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
