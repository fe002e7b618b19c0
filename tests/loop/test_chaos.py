"""Chaos: one 16-step run during which every kind of process of the run is killed with SIGKILL once, in a random
order, each at a random moment of a random step; the command is run again whenever the run stopped. In the end
every step is in metrics.jsonl exactly once and every step trained on the prompts an uninterrupted run trains on
(the data cursor continued exactly: the data source's order from the top, which test_checkpoint_in_background.py
shows an uninterrupted run trains on), 16 samples each.

Killed: the driver (alone, not its group), a trainer rank, the rollout manager, the engine actor, the router
(these five stop the run; all but the driver name the dead process in its last words) and the engine server
process (the run goes on: the engine restarts, docs/rollout.md "When an engine dies"). The order and moments come
from ``random.Random(CHAOS_SEED)``; set SLIME_HYDRA_CHAOS_SEED to try others (each must pass).
"""

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_hydra.config import PROJECT_ROOT
from tests.loop.test_engine_crash import cmdline, run_processes
from tests.loop.test_loop import SMALL, prompts_per_step, source_prompts, train_rows

pytestmark = pytest.mark.slow

CHAOS_SEED = int(os.environ.get("SLIME_HYDRA_CHAOS_SEED", "2211"))
STEPS = 16
VICTIMS = {  # name -> what its /proc/<pid>/cmdline starts with (Ray sets its workers' titles), and its last words
    "driver": (None, None),
    "trainer rank": ("ray::TrainRank", "the run stops: TrainRank"),
    "rollout manager": ("ray::RolloutManager", "the run stops: RolloutManager"),
    "engine actor": ("ray::EngineActor", "the run stops: EngineActor"),
    "router": ("sglang::router", "the router (pid"),
    "engine": ("-m slime_hydra.rollout.engines.embedded", None),  # a restart, not a stop
}


def _command(output_dir: Path) -> list[str]:
    return [sys.executable, str(PROJECT_ROOT / "launch.py"), f"output_dir={output_dir}", "run_name=r",
            f"num_steps={STEPS}", "save_every_steps=2", "debug.save_rollouts=true",
            "rollout.health_check_interval_s=0.5", *SMALL]


def _find(pids: list[int], prefix: str) -> list[int]:
    return [pid for pid in pids if (command := cmdline(pid)).startswith(prefix)
            or (prefix.startswith("-m ") and prefix in command)]


def test_every_process_killed_at_a_random_moment_loses_and_repeats_nothing(tmp_path, joined_ray):
    rng = random.Random(CHAOS_SEED)
    order = rng.sample(sorted(VICTIMS), len(VICTIMS))
    chaos, proc, log = tmp_path / "chaos", None, []
    try:
        for victim in order:
            if proc is None:
                proc = subprocess.Popen(_command(chaos), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                launched = time.time()
            # once this launch trained one more step, a random moment of the next: each kill costs at most three
            # steps of progress (two when the newest checkpoint's background write was not seen finished yet), so
            # the six find the run before its last step
            wait_for = len([r for r in train_rows(chaos / "r") if r["time"] > launched]) + 1
            deadline = time.monotonic() + 300
            while len(rows := [r for r in train_rows(chaos / "r") if r["time"] > launched]) < wait_for:
                assert proc.poll() is None, f"the run ended before {victim} was killed: {proc.stdout.read()[-3000:]}"
                assert time.monotonic() < deadline, f"no step within 300 s before killing {victim}"
                time.sleep(0.05)
            # a kill lands at a random moment of a step as long as the median step so far: the step before the kill
            # may be much longer (an engine restart), and the run's remaining steps can all fit into a fraction of that
            step_time = statistics.median(r["perf/step_time"] for r in train_rows(chaos / "r"))
            time.sleep(rng.uniform(0.0, 1.0) * step_time)
            prefix, last_words = VICTIMS[victim]
            pids = [proc.pid] if prefix is None else _find(run_processes(proc.pid, joined_ray, launched), prefix)
            assert len(pids) == 1, f"{victim}: {pids}"
            os.kill(pids[0], signal.SIGKILL)
            log.append(f"{victim} at step {max(r['step'] for r in train_rows(chaos / 'r'))}")
            if victim == "engine":
                continue
            out, _ = proc.communicate(timeout=90)  # stops within seconds (Ray notices a death in ~10 s)
            assert proc.returncode != 0, f"{victim}: {out[-3000:]}"
            if last_words is not None:
                assert last_words in out, f"{victim}: {out[-3000:]}"
            proc = None
        if proc is None:
            proc = subprocess.Popen(_command(chaos), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"kills {log}: {out[-3000:]}"
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = train_rows(chaos / "r")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), log
    assert sum(r["rollout/engine_restarts"] for r in rows) <= 1, log  # the engine's kill (0 if its step was redone)
    assert prompts_per_step(chaos / "r", STEPS) == source_prompts(STEPS, *SMALL), log
