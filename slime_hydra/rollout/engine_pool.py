"""``EnginePool``: the engines behind the router, kept in service (start, health, restart, router membership).

It owns the engines' ``EngineActor`` handles, one ``SGLangClient`` per engine (control calls go to each engine
directly: sglang-router does not forward them) and their membership in the router. The rollout manager generates
through the router; the weight relay (weight_relay.py) reaches the engines through ``on_weight_receivers``.

Health. Every ``rollout.health_check_interval_s`` (and whenever a ``/generate`` could not reach an engine) each
engine in service is checked: its process is alive (``EngineActor.alive``) and ``GET /health`` answers; 3 failed
answers in a row count as dead. A dead engine is removed from the router at once (so retries go to the others),
restarted on the same port (``EngineActor.restart``: it comes back with the initial checkpoint), given the newest
weights by the relay (``replay``), and only then added back to the router. When the newest weights cannot be
replayed from here (a broadcast or CUDA IPC sync: the tensors never passed through this process), the restarted
engine stays out of the router until the next sync reaches it (``register_awaiting``), and a broadcast group that
lost a member must be formed again (``group_stale``). When that leaves no engine in service (``needs_weights``),
requests wait for it and the loop has the trainer send the current weights again (loop.py ``resend_weights``).

The periodic check never dies silently: an error in it is printed and the checks go on, except when an engine's
actor itself is gone (Ray cannot restart it; found by the check or by a restart): then the pool is ``failed`` and
the rollout manager's next batch, eval, sync or request retry raises that error (``raise_if_failed``), so the run
stops naming it.

Syncs and replays exclude each other through ``weights_lock``: a restart replays only while no sync is running,
so a restarted engine always ends on the newest version.

Elastic. ``add`` starts one more engine while the run goes on: it gets the newest weights as a restarted engine
does (replay, or out of the router until the next sync, which forms a new broadcast group with it) and then takes
traffic. ``remove`` drains one: it leaves the router at once (no new request reaches it), the requests it holds
finish there (up to ``drain_timeout_s``; any left then fail and are retried through the router on the others,
as after a crash), and its server stops. A removed engine keeps its index (indices name log files and
metrics) and stays out of service for good; the last engine in service cannot be removed. With ``elastic``
(rollout.elastic), an engine whose actor is gone because its node left the Ray cluster is dropped as a removed one
(its requests are retried on the others) instead of stopping the run, while another engine is left; engines for
nodes that join come through ``add`` (rollout/elastic.py).
"""

import asyncio
from typing import Any, Awaitable, Callable, Optional

import ray

from slime_hydra.cluster.ray_cluster import node_gone
from slime_hydra.rollout.client import EngineError, EngineUnavailable, SGLangClient
from slime_hydra.rollout.router import Router, RouterError

UNHEALTHY_CHECKS = 3
"""Failed ``GET /health`` answers in a row after which a live engine process counts as dead and is restarted."""
HEALTH_TIMEOUT_S = 5.0
"""Seconds one health answer may take."""
REGISTER_TIMEOUT_S = 120.0
"""Seconds the router may take to list a (re-)registered engine healthy."""
AWAIT_POLL_S = 0.1
"""How often a request waiting for an engine looks again while restarted engines wait for weights."""
DRAIN_TIMEOUT_S = 60.0
"""Default seconds a removed engine may take to finish the requests it holds before they are retried elsewhere."""
DRAIN_POLL_S = 0.1
"""How often a draining engine's load is read."""
REMOVED = "removed"
"""The cause of a removed engine (``down``)."""


class InFlightLimit:
    """``async with limit:`` around one request: at most ``per_engine`` requests in flight per engine of the pool
    (``engines()``: how many now, the removed ones not counted), a limit that follows engines added and removed mid-run
    (asyncio.Semaphore's is fixed when it is made). A waiting request goes when one in flight ends and the limit has
    room: after an engine was added, as many as it has room for."""

    def __init__(self, per_engine: int, engines: Callable[[], int]):
        self.per_engine, self.engines = per_engine, engines
        self.held = 0
        """Requests in flight."""
        self._turn = asyncio.Condition()

    @property
    def limit(self) -> int:
        return self.per_engine * max(1, self.engines())

    async def __aenter__(self) -> None:
        async with self._turn:
            await self._turn.wait_for(lambda: self.held < self.limit)
            self.held += 1

    async def __aexit__(self, *_exc) -> None:
        async with self._turn:
            self.held -= 1
            self._turn.notify(max(0, self.limit - self.held))


class EnginePool:
    def __init__(self, engines: list, router: Router, health_check_interval_s: float, api_key: Optional[str] = None,
                 elastic: bool = False):
        """engines: EngineActor handles (already placed); router: not started yet; health_check_interval_s: 0
        disables the periodic checks (failed requests still trigger one); api_key: the run's key (rollout/auth.py),
        given to each engine when it starts and sent with every call to it; elastic: drop the engines of a node that
        left instead of stopping (module docstring)."""
        self.engines = list(engines)
        self.elastic = elastic
        self.nodes: list[str] = []
        """The Ray node id of each engine."""
        self.api_key = api_key
        self.router = router
        self.health_check_interval_s = health_check_interval_s
        self.urls: list[str] = []
        self.clients: list[SGLangClient] = []
        self.down: dict[int, str] = {}
        """Engines out of service (index -> why), from the moment a check finds them dead until they are back."""
        self.removed: set[int] = set()
        """Engines taken out for good (``remove``); they are in ``down`` too."""
        self.awaiting_weights: set[int] = set()
        """Restarted engines that wait for the next sync (the newest weights could not be replayed)."""
        self.group_stale = False
        """An engine restarted since the broadcast group was formed: the trainer must form it again."""
        self.weights_lock = asyncio.Lock()
        """Held by a weight sync from its begin to its finish, and by a replay into a restarted engine."""
        self.replay: Optional[Callable[[int], Awaitable[bool]]] = None
        """The weight relay's replay of the newest weights into engine i (False: it cannot, wait for a sync)."""
        self.restarts_total = 0
        """Engines found dead since start (each is restarted)."""
        self._restarts: dict[int, asyncio.Task] = {}
        self._unhealthy_checks: dict[int, int] = {}
        self._check_lock = asyncio.Lock()
        self._adding = asyncio.Lock()
        """Held by ``add`` while its engine starts."""
        self._monitor: Optional[asyncio.Task] = None
        self.failed: Optional[BaseException] = None
        """An engine actor died (found by the periodic check or a restart): no restart can help; raised by
        raise_if_failed."""

    async def start(self) -> list[str]:
        """Start the router and every engine, register the engines, wait until the router sees them healthy."""
        self.router.start()
        self.urls = list(await asyncio.gather(*[e.start.remote(self.api_key) for e in self.engines]))
        self.nodes = list(await asyncio.gather(*[e.node_id.remote() for e in self.engines]))
        for url in self.urls:
            self.router.add_worker(url)
        await asyncio.to_thread(self.router.wait_ready, len(self.urls), REGISTER_TIMEOUT_S)
        self.clients = [SGLangClient(url, api_key=self.api_key) for url in self.urls]
        if self.health_check_interval_s > 0:
            self._monitor = asyncio.ensure_future(self._watch())
        return self.urls

    # ---- calling the engines -------------------------------------------------------------------------------------
    def weight_receivers(self) -> list[int]:
        """The engines a weight sync reaches: those in service and restarted ones waiting for weights."""
        return [i for i in range(len(self.clients)) if i not in self.down or i in self.awaiting_weights]

    async def on_engines(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` of every engine in service (engines being restarted are skipped)."""
        return list(await asyncio.gather(*[getattr(self.clients[i], method)(*args, **kwargs)
                                           for i in range(len(self.clients)) if i not in self.down]))

    async def on_engines_or_take_out(self, method: str, *args, **kwargs) -> None:
        """Call ``method`` of every engine in service; an engine that cannot be reached (it died after the last
        check) is taken out and restarted instead of failing the call (a weight sync's pause / resume)."""
        await self._call_or_take_out([i for i in range(len(self.clients)) if i not in self.down], method, args, kwargs)

    async def on_weight_receivers(self, method: str, *args, **kwargs) -> None:
        """Call every engine a weight sync reaches: those in service and restarted ones waiting for weights. One
        that died during the sync is taken out and restarted (it gets the newest weights when it is back: replay,
        or the next sync) instead of failing the sync for the others."""
        await self._call_or_take_out(self.weight_receivers(), method, args, kwargs)

    async def _call_or_take_out(self, targets: list[int], method: str, args: tuple, kwargs: dict) -> None:
        """``method`` on every engine of ``targets`` at once; unreachable ones are taken out, other errors raised."""
        results = await asyncio.gather(*[getattr(self.clients[i], method)(*args, **kwargs) for i in targets],
                                       return_exceptions=True)
        for i, result in zip(targets, results):
            if isinstance(result, EngineUnavailable):
                self._found_dead(i, f"{method} could not reach it ({result})")
            elif isinstance(result, BaseException):
                raise result

    async def gpu_peaks(self) -> list[int]:
        """The most GPU memory each reachable engine in service ever allocated (bytes; none on CPU). An engine that
        died since the last check is skipped: this is a report, the health checks deal with it."""
        infos = await asyncio.gather(*[self.clients[i].server_info() for i in range(len(self.clients))
                                       if i not in self.down], return_exceptions=True)
        return [info["max_memory_allocated_bytes"] for info in infos
                if isinstance(info, dict) and "max_memory_allocated_bytes" in info]

    async def abort_all(self, unreachable: Callable[[BaseException], bool]) -> None:
        """/abort_request abort_all on every engine in service; an engine that died meanwhile (``unreachable``
        errors) is left to the health checks, any other error is raised."""
        results = await asyncio.gather(*[self.clients[i].abort(abort_all=True)
                                         for i in range(len(self.clients)) if i not in self.down],
                                       return_exceptions=True)
        for error in results:
            if isinstance(error, BaseException) and not unreachable(error):
                raise error

    async def leave_weight_group(self, group_name: str) -> None:
        """The receivers leave the broadcast group (before a new one forms; a restarted engine has none, and one
        out of service is not asked)."""
        for i in self.weight_receivers():
            try:
                await self.clients[i].destroy_weights_update_group(group_name)
            except EngineError:
                pass
        self.group_stale = False

    # ---- health and restarts -------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            try:
                await self.check()
            except Exception as error:
                print(f"rollout: the engine health check failed: {type(error).__name__}: {error}", flush=True)
                if isinstance(error, ray.exceptions.RayActorError):  # an engine's actor is gone: no check can help
                    self.failed = error
                    return

    @property
    def kept(self) -> int:
        """Engines not removed (those down for a restart included)."""
        return len(self.engines) - len(self.removed)

    @property
    def in_service(self) -> int:
        """Engines in service now (not down, not removed)."""
        return len(self.engines) - len(self.down)

    def raise_if_failed(self) -> None:
        """Raise the error that stopped the health checks, if one did."""
        if self.failed is not None:
            raise self.failed

    async def check(self) -> list[int]:
        """Check every engine in service once (process alive, GET /health); start the restart of each dead one and
        return their indices. Concurrent callers share one check."""
        if self._check_lock.locked():
            async with self._check_lock:
                return []
        async with self._check_lock:
            dead = []
            for i, (actor, client) in enumerate(zip(self.engines, self.clients)):
                if i in self.down:
                    continue
                try:
                    alive = await actor.alive.remote()
                except ray.exceptions.RayActorError:
                    if await self._left_with_its_node(i):
                        continue
                    raise
                if not alive:
                    cause = f"its process (pid {await actor.pid.remote()}) exited"
                elif await client.health(timeout_s=HEALTH_TIMEOUT_S):
                    self._unhealthy_checks[i] = 0
                    continue
                else:
                    self._unhealthy_checks[i] = self._unhealthy_checks.get(i, 0) + 1
                    if self._unhealthy_checks[i] < UNHEALTHY_CHECKS:
                        continue
                    cause = f"GET /health failed {UNHEALTHY_CHECKS} checks in a row"
                if i in self.down:  # found dead during the awaits above (a failed call): its restart runs already,
                    continue        # and a second one would stop the first's fresh process under its replay
                await self._take_out(i, cause)  # out of the router before the caller retries
                self._restarts[i] = asyncio.ensure_future(self._restart(i))
                dead.append(i)
            return dead

    def _found_dead(self, i: int, cause: str) -> None:
        """Take engine i out of service at once (its removal from the router and its restart follow)."""
        if i in self.down:
            return
        self.down[i] = cause  # at once: no call made after this returns reaches it
        self.group_stale = True
        self._restarts[i] = asyncio.ensure_future(self._take_out_and_restart(i, cause))

    async def _take_out_and_restart(self, i: int, cause: str) -> None:
        if self.elastic:  # an engine whose node left is dropped, not counted as restarted (_left_with_its_node)
            try:
                await self.engines[i].alive.remote()
            except ray.exceptions.RayActorError:
                if await self._left_with_its_node(i):
                    return
        await self._take_out(i, cause)
        await self._restart(i)

    async def _take_out(self, i: int, cause: str) -> None:
        """Mark engine i down and remove it from the router, so no new request reaches it."""
        url = self.urls[i]
        self.down[i] = cause
        self.group_stale = True  # the broadcast group (if any) lost a member
        self._unhealthy_checks[i] = 0
        self.restarts_total += 1
        print(f"rollout: engine {i} ({url}) is down: {cause}; restarting it (log engine_{i}.log)", flush=True)
        try:
            await asyncio.to_thread(self.router.remove_worker, url)
        except RouterError as error:  # the router may have dropped it already; the restart goes on either way
            print(f"rollout: removing engine {i} from the router: {error}", flush=True)

    async def _restart(self, i: int) -> None:
        """Restart engine i on its port, give it the newest weights, put it back in the router."""
        url, cause = self.urls[i], self.down[i]
        try:
            new_url = await self.engines[i].restart.remote()
            if new_url != url:
                raise RuntimeError(f"restarted at {new_url}, not on its old address {url}")
            if await self._bring_in(i, f"restarted after: {cause}"):
                print(f"rollout: engine {i} ({url}) is back", flush=True)
        except Exception as error:
            if isinstance(error, ray.exceptions.RayActorError) and await self._left_with_its_node(i):
                return
            self.down[i] = f"{cause}; the restart failed: {type(error).__name__}: {error}"
            if isinstance(error, EngineError):  # the restarted server stopped answering: say what became of it
                self.down[i] += f" (the restarted server: {await self._describe(i)})"
            print(f"rollout: engine {i} ({url}) {self.down[i]}", flush=True)
            if isinstance(error, ray.exceptions.RayActorError):  # the actor is gone, as in _watch: the run stops
                self.failed = error

    async def _left_with_its_node(self, i: int) -> bool:
        """``elastic``: engine i's actor is gone because its node left the cluster; drop it for good (as ``remove``
        does, with no drain: its requests fail and are retried on the others) and return True. False when the pool
        is not elastic, the node is still alive (the actor died by itself) or no other engine is left."""
        if not self.elastic:
            return False
        if i in self.removed:  # dropped already (by the check, or a restart that failed the same way)
            return True
        if not [j for j in range(len(self.engines)) if j not in self.removed and j != i]:
            return False
        node = {n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes)}.get(self.nodes[i], {})
        if not node or not await asyncio.to_thread(node_gone, node):
            return False
        async with self.weights_lock:  # a sync's receivers do not change under it
            self.removed.add(i)
            self.down[i] = f"{REMOVED}: its node {node.get('NodeManagerAddress', self.nodes[i])} left the cluster"
            self.awaiting_weights.discard(i)
            self.group_stale = True
        try:
            await asyncio.to_thread(self.router.remove_worker, self.urls[i])
        except RouterError:  # the router may have dropped it already
            pass
        print(f"rollout: engine {i} ({self.urls[i]}) dropped: {self.down[i]}", flush=True)
        return True

    async def _bring_in(self, i: int, how: str) -> bool:
        """Give engine i (out of service) the newest weights and put it in the router: True. When they cannot be
        replayed from here it waits out of the router for the next sync (``register_awaiting``): False."""
        async with self.weights_lock:
            if self.replay is not None and not await self.replay(i):
                self.awaiting_weights.add(i)
                self.down[i] = f"{how}; waits for the next weight sync"
                self.group_stale = True
                return False
            await self._register(i)
            return True

    async def _describe(self, i: int) -> str:
        try:
            return await self.engines[i].describe.remote()
        except ray.exceptions.RayActorError as error:
            return f"its actor is gone ({type(error).__name__})"

    async def _register(self, i: int) -> None:
        """Add engine i back to the router and wait until the router lists it healthy."""
        url = self.urls[i]
        await asyncio.to_thread(self.router.add_worker, url)
        await asyncio.to_thread(self.router.wait_worker_healthy, url, REGISTER_TIMEOUT_S)
        self.down.pop(i, None)
        self.awaiting_weights.discard(i)

    async def register_awaiting(self) -> None:
        """After a sync reached them: restarted engines that waited for weights go back into the router."""
        for i in sorted(self.awaiting_weights):
            await self._register(i)
            print(f"rollout: engine {i} ({self.urls[i]}) is back (a weight sync reached it)", flush=True)

    # ---- elastic: engines added and removed while the run goes on -----------------------------------------------
    async def add(self, make: Callable[[int], Any]) -> int:
        """Start one more engine (``make(index)``: its EngineActor handle, placed), give it the newest weights, put it
        in the router (or keep it out until the next sync, as a restarted engine); returns its index. Adds start
        their engines one at a time, so the index an actor is made with (its log's name) is the one it gets."""
        async with self._adding:
            i = len(self.engines)
            actor = make(i)
            url = await actor.start.remote(self.api_key)
            node = await actor.node_id.remote()
            self.engines.append(actor)
            self.nodes.append(node)
            self.urls.append(url)
            self.clients.append(SGLangClient(url, api_key=self.api_key))
            self.down[i] = "joining"  # no request or sync reaches it until it has the newest weights
            self.group_stale = True  # a broadcast group is formed again with it
        joined = await self._bring_in(i, "joined")
        print(f"rollout: engine {i} ({url}) joined; it takes traffic "
              f"{'now' if joined else 'after the next weight sync'}", flush=True)
        return i

    async def remove(self, i: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> int:
        """Drain engine i and stop it (see the module docstring); returns the requests it still held when the drain
        timed out (they are retried on the other engines)."""
        if not 0 <= i < len(self.engines) or i in self.removed:
            raise ValueError(f"no engine {i} in service to remove (engines: {self.down_report()})")
        if not [j for j in range(len(self.engines)) if j not in self.down and j != i]:
            raise ValueError(f"engine {i} is the last engine in service: add one before removing it")
        async with self.weights_lock:  # a sync's receivers do not change under it (it holds the lock throughout)
            restart = self._restarts.get(i)
            if restart is not None and not restart.done():
                restart.cancel()
            self.removed.add(i)
            self.down[i] = REMOVED
            self.awaiting_weights.discard(i)
            self.group_stale = True
        url = self.urls[i]
        try:
            await asyncio.to_thread(self.router.remove_worker, url)
        except RouterError as error:  # not listed (it was out of service): nothing to take out
            print(f"rollout: removing engine {i} from the router: {error}", flush=True)
        loop = asyncio.get_running_loop()
        deadline, held = loop.time() + drain_timeout_s, 0
        while True:
            try:
                held = sum(load["num_reqs"] for load in await self.clients[i].get_load())
            except EngineError:  # already gone: nothing to drain
                held = 0
            if held == 0 or loop.time() >= deadline:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await self.engines[i].stop.remote()
        print(f"rollout: engine {i} ({url}) removed" + (f"; {held} requests it held are retried" if held else ""),
              flush=True)
        return held

    def needs_weights(self) -> bool:
        """Every engine is out of service and at least one restarted engine waits for weights that only the trainer
        can send (broadcast / CUDA IPC syncs): generation cannot go on until the loop has them sent again."""
        return bool(self.awaiting_weights) and len(self.down) == len(self.engines)

    async def await_an_engine(self, timeout_s: float = 300.0) -> None:
        """When every engine is down, wait (up to ``timeout_s``) until a restart, or a weight sync that reaches an
        engine waiting for weights, has brought one back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.down) == len(self.engines) and loop.time() < deadline:
            running = [t for t in self._restarts.values() if not t.done()]
            if running:
                await asyncio.wait(running, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            elif self.awaiting_weights:
                await asyncio.sleep(AWAIT_POLL_S)
            else:
                return

    async def settled(self, timeout_s: float = 300.0) -> None:
        """Wait until no restart is in progress."""
        running = [t for t in self._restarts.values() if not t.done()]
        if running:
            await asyncio.wait_for(asyncio.gather(*running), timeout_s)

    def down_report(self) -> str:
        """Which engines are out of service and why (for error messages)."""
        if self.failed is not None:
            return f"the health checks stopped: {type(self.failed).__name__}: {self.failed}"
        out = {i: cause for i, cause in self.down.items() if i not in self.removed}
        if not out:
            return "every engine passed its last health check"
        return "; ".join(f"engine {i} ({self.urls[i]}): {cause}" for i, cause in sorted(out.items()))

    async def status(self) -> list[dict]:
        """Per engine: index, url, up (in service), cause (why it is down, else None; ``REMOVED`` for a removed
        one, followed by why when its node left), in_router and router_healthy (as the router lists it)."""
        workers = {w.get("url"): w for w in await asyncio.to_thread(self.router.workers)}
        return [{"index": i, "url": url, "up": i not in self.down, "cause": self.down.get(i),
                 "in_router": url in workers, "router_healthy": bool(workers.get(url, {}).get("is_healthy"))}
                for i, url in enumerate(self.urls)]

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for task in self._restarts.values():
            task.cancel()
        for client in self.clients:
            await client.close()
        stopped = await asyncio.gather(*[e.stop.remote() for e in self.engines], return_exceptions=True)
        self.router.stop()
        for i, result in enumerate(stopped):  # a dead engine actor has nothing left to stop; anything else is news
            if isinstance(result, BaseException) and not isinstance(result, ray.exceptions.RayActorError):
                raise result
