"""``WeightRelay``: the rollout side of a weight sync, from the trainer's calls to every engine, and the replay of
the newest weights into a restarted engine.

The trainer (train/weight_sync.py) drives a sync through the rollout manager, which forwards each call here:

    begin()                                   hold generation in place (a rollout may be running in async mode)
    from_disk | from_distributed | from_tensor | from_cuda_ipc     one bucket each (the last carries the version)
    from_adapter_dir                          a LoRA adapter alone, as a named adapter (below)
    finish(version)                           flush caches, resume, make ``version`` current in the buffer

A LoRA adapter synced by disk follows SGLang's LoRA protocol, which the embedded engine speaks too: every engine
loads the PEFT directory as adapter ``policy_v<version>`` (``/load_lora_adapter``) and relabels its weights
(``/update_weight_version``); from ``finish`` on, every /generate names it (the rollout manager's client sends
``lora_path``). The one before is unloaded at the start of the next sync, before generation is held (an unload
waits for the requests that use it: in async mode a request that began before a sync finishes on the adapter it
began with), so an engine holds at most two adapters.

A sync holds the pool's ``weights_lock`` from ``begin`` to ``finish`` (no replay into a restarted engine
meanwhile) and releases it and the pause on every path (``finish``, or ``abort`` when the sync failed). An engine
that dies during a sync is taken out and restarted (``EnginePool.on_weight_receivers``); the others get the whole
sync. A broadcast fails for every member when one dies: ``abort`` then names the engines lost, and the trainer runs
the sync once more without them.

What is kept of the newest completed sync, so a restarted engine can be given it again (``replay``):

- ``disk``: the trainer's export directory and version (``/update_weights_from_disk`` again);
- ``adapter``: the adapter directory and version (``/load_lora_adapter`` again, under the same name);
- ``tensor`` on CPU: the buckets pass through this process, so it keeps the newest tensor of every name (one copy
  of the model in host memory) and sends them again;
- no sync yet: nothing to do (the initial checkpoint is version 0);
- ``distributed`` broadcast and CUDA IPC: the tensors never pass through here. The restarted engine stays out of
  the router until the next sync reaches it (``EnginePool.register_awaiting``); the broadcast group that lost a
  member is formed again by the trainer (``group_stale``).
"""

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional

from slime_hydra.rollout.client import EngineError
from slime_hydra.rollout.engine_pool import EnginePool

WEIGHT_GROUP = "weight_update_group"
"""The broadcast group's name on every engine."""
REPLAY_BUCKET_BYTES = 256 * 2**20
"""Largest request when replaying kept tensors into a restarted engine."""


@dataclass
class WeightSource:
    """What the newest completed weight sync was, so that a restarted engine can be given it again."""

    kind: str
    """initial (no sync yet) | disk | adapter | tensor | broadcast (distributed or CUDA IPC: not replayable here)."""
    version: int = 0
    """The weight version the sync set."""
    path: Optional[str] = None
    """disk: the exported HF checkpoint directory; adapter: the PEFT adapter directory."""


def adapter_name(version: int) -> str:
    """The name engines load the policy's LoRA adapter of ``version`` under (SGLang's ``lora_name``)."""
    return f"policy_v{version}"


class WeightRelay:
    def __init__(self, pool: EnginePool, on_version: Callable[[int], int],
                 use_adapter: Callable[[Optional[str]], None] = lambda name: None):
        """on_version(version) -> groups dropped: the buffer's reaction to a new policy version (staleness);
        use_adapter(name): every /generate from now on runs with that named adapter (the manager's client)."""
        self.pool, self.on_version, self.use_adapter = pool, on_version, use_adapter
        self._stale_adapter: Optional[str] = None
        """The named adapter the newest one replaced (unloaded at the next sync)."""
        self.newest = WeightSource("initial")
        self._incoming: Optional[WeightSource] = None
        self._tensors: dict = {}
        self._holds_lock = False
        self._paused = False
        self._down_at_begin: set[int] = set()
        pool.replay = self.replay

    # ---- one sync ------------------------------------------------------------------------------------------------
    async def begin(self) -> None:
        """Find engines that died since the last check (a sync must not wait on them), then hold generation in
        place (async mode: a rollout may be running) so updates apply at once."""
        await self.pool.weights_lock.acquire()
        self._holds_lock = True
        self._down_at_begin = set(self.pool.down)
        try:
            await self.pool.check()  # a dead engine is taken out (and restarted); the sync goes to the others
            await self._unload_stale_adapter()
            await self.pool.on_engines_or_take_out("pause_generation", mode="in_place")
            self._paused = True
        except BaseException:
            await self.abort()
            raise

    async def from_disk(self, path: str, version: int) -> None:
        await self.pool.on_weight_receivers("update_weights_from_disk", path, weight_version=str(version))
        self._incoming = WeightSource("disk", version, str(path))

    async def from_adapter_dir(self, path: str, version: int) -> None:
        """Every engine loads the PEFT adapter directory as ``adapter_name(version)`` and relabels its weights."""
        await self.pool.on_weight_receivers("load_lora_adapter", adapter_name(version), path)
        await self.pool.on_weight_receivers("update_weight_version", str(version))
        self._incoming = WeightSource("adapter", version, str(path))

    def group_size(self) -> int:
        """1 (the trainer) + the engines the next broadcast group will hold (the sync's receivers; the set cannot
        change while the sync holds the lock: restarts wait for it)."""
        return 1 + len(self.pool.weight_receivers())

    async def join_group(self, master_address: str, master_port: int, backend: str) -> None:
        """Join the sync's receivers to the broadcast group whose rank 0 is the trainer (the k-th receiver is rank
        1 + k). An engine out of service is left out; the group is formed again when it is back (group_stale)."""
        members = self.pool.weight_receivers()
        if self.pool.group_stale:  # an engine died or restarted: the survivors leave the old group first
            await self.pool.leave_weight_group(WEIGHT_GROUP)
        await asyncio.gather(*[
            self.pool.clients[i].init_weights_update_group(master_address, master_port, 1 + k, 1 + len(members),
                                                           WEIGHT_GROUP, backend=backend)
            for k, i in enumerate(members)])

    async def from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                               version: Optional[int]) -> None:
        """Receive one broadcast bucket."""
        self._incoming = WeightSource("broadcast")
        await self.pool.on_weight_receivers("update_weights_from_distributed", names, dtypes, shapes, WEIGHT_GROUP,
                                            weight_version=_version(version), flush_cache=False)

    async def from_tensor(self, named: dict, version: Optional[int]) -> None:
        """Load one bucket of tensors sent through Ray (kept for restarted engines)."""
        self._tensors.update(named)
        self._incoming = WeightSource("tensor")
        await self.pool.on_weight_receivers("update_weights_from_tensor", named, weight_version=_version(version),
                                            flush_cache=False)

    async def from_cuda_ipc(self, handles: list[dict], version: Optional[int]) -> None:
        """Colocated GPUs: every engine copies one bucket from the trainer's GPU memory (the handle of its GPU)."""
        self._incoming = WeightSource("broadcast")
        await self.pool.on_weight_receivers("update_weights_from_cuda_ipc", handles,
                                            weight_version=_version(version), flush_cache=False)

    async def finish(self, version: int) -> int:
        """Flush the engines' caches, resume generation, make ``version`` current; returns the groups the buffer
        dropped as stale. Restarted engines this sync reached go back into the router."""
        try:
            await self.pool.on_weight_receivers("flush_cache")
            if self._paused:
                await self.pool.on_engines_or_take_out("continue_generation")
                self._paused = False
            if self._incoming is not None:
                previous = self.newest
                self.newest = WeightSource(self._incoming.kind, version, self._incoming.path)
                self._incoming = None
                if self.newest.kind == "adapter":
                    self.use_adapter(adapter_name(version))
                if previous.kind == "adapter":
                    self._stale_adapter = adapter_name(previous.version)
                if self.newest.kind != "tensor":
                    self._tensors = {}
                await self.pool.register_awaiting()
        finally:
            self._release()
        return self.on_version(version)

    async def abort(self) -> list[int]:
        """The sync failed: resume generation and release the lock (the engines may hold a mix of old and new
        tensors; the next sync overwrites every one). Returns the engines found dead since ``begin``: when there
        are some, the failure may be theirs (a broadcast fails for every member when one dies) and the same sync
        can be run again without them (train/weight_sync.py)."""
        self._incoming = None
        try:
            await self.pool.check()
            if self._paused:
                self._paused = False
                await self.pool.on_engines_or_take_out("continue_generation")
        finally:
            self._release()
        return sorted(set(self.pool.down) - self._down_at_begin)

    async def _unload_stale_adapter(self) -> None:
        """Unload the adapter the newest one replaced from every engine in service (each answers once the requests
        using it have ended); an engine restarted since then never had it."""
        name, self._stale_adapter = self._stale_adapter, None
        if name is None:
            return

        async def unload(i: int) -> None:
            try:
                await self.pool.clients[i].unload_lora_adapter(name)
            except EngineError as error:  # not loaded there (restarted), or gone (the health checks see to it)
                print(f"rollout: engine {i} did not unload LoRA adapter {name}: {error}", flush=True)

        await asyncio.gather(*[unload(i) for i in range(len(self.pool.clients)) if i not in self.pool.down])

    def _release(self) -> None:
        if self._holds_lock:
            self._holds_lock = False
            self.pool.weights_lock.release()

    # ---- restarted engines ---------------------------------------------------------------------------------------
    async def replay(self, i: int) -> bool:
        """Give restarted engine i the newest synced weights; False when they cannot be replayed from here."""
        source, client = self.newest, self.pool.clients[i]
        version = str(source.version)
        if source.kind == "disk":
            await client.update_weights_from_disk(source.path, weight_version=version)
        elif source.kind == "adapter":
            await client.load_lora_adapter(adapter_name(source.version), source.path)
            await client.update_weight_version(version)
        elif source.kind == "tensor":
            from slime_hydra.weight_transport import buckets  # torch: only in runs whose weights pass through here

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
        print(f"rollout: engine {i} got weight version {version} again ({source.kind})", flush=True)
        return True


def _version(version: Optional[int]) -> Optional[str]:
    """Only a sync's last bucket carries the new version (an engine reports it once it has every tensor)."""
    return None if version is None else str(version)
