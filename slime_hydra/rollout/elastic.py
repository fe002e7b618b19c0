"""rollout.elastic: the engines follow the Ray cluster's nodes while the run goes on.

    watcher = NodeWatcher(pool, spec, gpus_per_engine)   # the rollout manager's, when rollout.elastic is on
    await watcher.start()                               # the nodes up now are the run's own
    ...                                                 # every NODE_POLL_S: engines for each node that joined
    watcher.stop()

A node that joins the run's Ray cluster (``ray start --address=<head>`` with the job's token, e.g. from a second
SLURM job) gets engines on it, pinned there: one per ``rollout.gpus_per_engine`` of its GPUs, one on a CPU node.
Each is started from the run's engine spec and joins as ``python -m slime_hydra.engines add`` does
(``EnginePool.add``): the newest weights (replayed, or the next sync), then the router. A node that leaves: the
pool drops its engines when it finds their actors gone (engine_pool.py), and the run goes on with the others.
"""

import asyncio
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NODE_POLL_S = 2.0
"""Seconds between two looks at the cluster's nodes."""


class NodeWatcher:
    def __init__(self, pool, spec, gpus_per_engine: int):
        """pool: the EnginePool; spec: the run's engine spec (engines/actor.EngineSpec); gpus_per_engine: GPUs of an
        engine (rollout.gpus_per_engine), 0 in a CPU run (a node gets one engine)."""
        self.pool, self.spec, self.gpus_per_engine = pool, spec, gpus_per_engine
        self.known: set[str] = set()
        """Ids of the nodes seen so far (a node that leaves and comes back is a new node: Ray gives it a new id)."""
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self.known = set(await self._alive())
        self._task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _alive(self) -> dict[str, dict]:
        return {n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(NODE_POLL_S)
            try:
                await self.follow()
            except Exception as error:  # printed, and the watch goes on: the run does not depend on new nodes
                print(f"rollout: following the cluster's nodes failed: {type(error).__name__}: {error}", flush=True)

    async def follow(self) -> list[int]:
        """Start engines on every node that joined since the last look; returns their indices."""
        added = []
        for node_id, node in (await self._alive()).items():
            if node_id in self.known:
                continue
            self.known.add(node_id)
            gpus = self.gpus_per_engine
            count = int(node["Resources"].get("GPU", 0) // gpus) if gpus else 1
            where = NodeAffinitySchedulingStrategy(node_id, soft=False)
            print(f"rollout: node {node['NodeManagerAddress']} joined the cluster: starting {count} engine(s) on it",
                  flush=True)
            for _ in range(count):
                added.append(await self.pool.add(lambda index: self.spec.make(index, gpus, where)))
        return added
