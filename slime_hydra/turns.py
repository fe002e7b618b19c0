"""Colocated on GPUs, the trainer and the engines take turns with the GPU memory (slime's offload), unless the memory
plan fits both on one GPU together (``cluster.colocate_offload``, config/memory.py: ``colocated_moves``).

    turns = GpuTurns(trainer_groups, manager, active)
    turns.hand_to("engines", timer)   # to generate: the trainer's parameters and optimizer state go to pinned host
                                      # memory (train/offload.py); the engines take back what they gave
    turns.hand_to("trainer", timer)   # to train: the engines release their weights and KV cache (their addresses and
                                      # CUDA graphs stay: rollout/engines/embedded/memory.py); the trainer onloads
                                      # its parameters, its optimizer state arrives during the logprob passes
    turns.hand_to("both", timer)      # to sync weights (CUDA IPC): the engines resume their weights only, as slime
                                      # does; their cache comes back once the trainer is out (or at a request's
                                      # need); the trainer's optimizer state starts for the host meanwhile
    turns.metrics()                   # this step's moves, and the trainer's GPU memory in each state

Handing to the trainer, its onload runs while the engines release (the copies go opposite ways over PCIe) when
every rank's state fits the device's free memory already (``Offloadable.onload_fits``; a release only adds free
memory); else after the release. Everything is timed as the step's ``offload`` phase and by part:
``perf/offload_<part>_time`` for trainer_offload, engine_resume, release_and_onload (or engine_release and
trainer_onload), in seconds.
"""

import time

import ray

from slime_hydra.tracking.phases import StepTimer


class GpuTurns:
    """Who holds the colocated GPUs' memory ("engines", "trainer" or "both") and the moves between them."""

    def __init__(self, groups: list, manager, active: bool):
        """groups: the TrainGroups (actor, critic) whose ranks share the engines' GPUs; manager: the RolloutManager
        actor; active: memory moves at all (colocated on GPUs, ``colocated_moves``, trainer and engines both there)."""
        self.ranks = [rank for group in groups for rank in group.ranks]
        self.manager = manager
        self.active = active
        self.holder = "both"
        """Who holds the memory now (at the start both: the trainer loaded, the engines resident)."""
        self.trainer_bytes: dict[str, float] = {}
        """The trainer's GPU memory (bytes, largest rank) after the last hand-over to each holder."""
        self.move_times: dict[str, float] = {}
        """This step's moves by part (s)."""

    def hand_to(self, holder: str, timer: StepTimer) -> None:
        if not self.active or holder == self.holder:
            return
        with timer.phase("offload"):
            if holder == "engines":
                held = self._timed("trainer_offload", self._ranks("offload"))
                self._timed("engine_resume", [self.manager.resume_memory.remote()])
            elif holder == "trainer" and all(ray.get(self._ranks("onload_fits"))):
                held = self._timed("release_and_onload", [self.manager.release_memory.remote()]
                                   + self._ranks("onload"))[1:]
            else:
                if holder == "trainer":
                    self._timed("engine_release", [self.manager.release_memory.remote()])
                # on to "both" after training the trainer is loaded already; its optimizer state starts for the host
                if self.holder == "trainer":
                    held, leaving = [self.trainer_bytes["trainer"]], self._ranks("start_offload")
                else:
                    held, leaving = self._timed("trainer_onload", self._ranks("onload")), []
                if holder == "both":
                    self._timed("engine_resume", [self.manager.resume_memory.remote(["weights"])] + leaving)
        self.holder = holder
        self.trainer_bytes[holder] = max(held)

    def metrics(self) -> dict[str, float]:
        """perf/trainer_gpu_gb_<holder> and this step's perf/offload_<part>_time; starts the next step's count."""
        out = {f"perf/trainer_gpu_gb_{k}": v / 2**30 for k, v in self.trainer_bytes.items()}
        out.update({f"perf/offload_{k}_time": v for k, v in self.move_times.items()})
        self.move_times = {}
        return out

    def _ranks(self, method: str) -> list:
        return [rank.call.remote(method) for rank in self.ranks]

    def _timed(self, part: str, futures: list) -> list:
        """``ray.get(futures)``, its time added to ``move_times[part]``."""
        began = time.monotonic()
        results = ray.get(futures)
        self.move_times[part] = self.move_times.get(part, 0.0) + time.monotonic() - began
        return results
