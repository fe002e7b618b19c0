"""A process's Python heap: how long its garbage collections take (``GcTimes``), and freezing the objects that live
as long as the process (``freeze``). Used by the processes that serve a whole run and allocate per request or per
step: the embedded engine (its ``server_info`` reports the collections) and the rollout manager (metric
``perf/rollout_gc_time``).

Why this matters for speed: CPython's cyclic collector walks every tracked container object of a generation when it
collects it. A collection of the oldest generation walks them all: torch's, transformers' and Ray's objects, a
model's modules and parameters, a prompt set and, once decode layers are compiled, dynamo's and inductor's graphs
and guards. It runs whenever enough objects have survived into that generation, and a step's samples do. Measured
(docs/benchmarks.md): such a collection stalled an HTTP round of the 0.5B engine bench on an H200 by 0.2-0.4 s (in
the engine or in the bench client), and the rollout manager of the CPU addition loop collected its oldest generation
every 2-4 s, 142-159 ms each. Objects frozen by ``gc.freeze`` are never walked again; what comes later is walked as
before.
"""

import gc
import time


class GcTimes:
    """Collections in this process while started: how many of each generation (0, 1, 2) ran, and the seconds they
    took (``gc.callbacks``, which CPython calls before and after every collection, on the thread that triggered
    it). Process-wide: a second engine in the same process (the tests) counts the same collections."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began = None

    def start(self) -> None:
        gc.callbacks.append(self._clock)

    def stop(self) -> None:
        if self._clock in gc.callbacks:
            gc.callbacks.remove(self._clock)

    def as_dict(self) -> dict:
        return {"collections": list(self.collections), "seconds": list(self.seconds),
                "frozen_objects": gc.get_freeze_count()}

    def _clock(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._began
            self._began = None


def freeze() -> None:
    """Collect what is garbage now, then move every surviving object to the permanent generation, out of reach of
    later collections (``gc.freeze``). For a process that is the engine or the rollout manager and nothing else:
    objects frozen and later dropped are freed by reference counting as usual, but cycles among them stay until the
    process ends, which is why an engine sharing its process (the tests) leaves the heap alone. The engine calls
    this once its model is loaded and after each step that captured a CUDA graph (torch.compile's traces come
    first); the rollout manager once its router and engines are up."""
    gc.collect()
    gc.freeze()
