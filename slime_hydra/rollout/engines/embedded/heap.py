"""The engine process's Python heap: how long its garbage collections take (``GcTimes``, reported by
``server_info``), and freezing the objects that live as long as the engine (``freeze``).

Why this matters for speed: CPython's cyclic collector walks every tracked container object of a generation when it
collects it. A collection of the oldest generation walks them all: the model's modules and parameters, transformers'
and torch's imported code and, once the decode layers are compiled, dynamo's and inductor's graphs and guards. On an
H200 an HTTP round of the 0.5B bench took ~0.3 s longer whenever such a collection fell into it (docs/benchmarks.md).
Objects frozen by ``gc.freeze`` are never walked again; what the engine allocates per request is short-lived and
collected young.
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
    later collections (``gc.freeze``). An engine that owns its process (``Engine(freeze_heap=True)``, the command
    line) calls this once its model is loaded and again after each step that captured a CUDA graph (which follows
    torch.compile's traces, the other large batch of long-lived objects). Objects frozen and later dropped are freed
    by reference counting as usual; cycles among them stay until the process ends, which is why an engine sharing
    its process (the tests) leaves the heap alone."""
    gc.collect()
    gc.freeze()
