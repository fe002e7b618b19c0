"""Small job bodies for the SLURM tests: ``body(cfg, run_dir)`` run on rank 0 with RAY_ADDRESS set (launch/submit.py)."""

import json
import os
import time
from pathlib import Path

from slime_hydra import preempt


def ray_nodes(cfg, run_dir: Path) -> str:
    """Connect to the job's Ray and record what joined: nodes, CPUs, and where a task actually ran."""
    import ray

    ray.init(address="auto", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]

        @ray.remote(num_cpus=0)
        def env_of_worker():
            return {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "PMI_", "PMIX_", "SUBMITIT_"))}

        (run_dir / "ray.json").write_text(json.dumps({
            "address": os.environ["RAY_ADDRESS"],
            "nodes": len(nodes),
            "cpus": sum(n["Resources"].get("CPU", 0) for n in nodes),
            "worker_scheduler_env": ray.get(env_of_worker.remote()),
        }))
    finally:
        ray.shutdown()
    return "done"


def metrics(cfg, run_dir: Path) -> str:
    """Write a few metrics.jsonl lines as the loop does (what status reads), without Ray."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in range(1, cfg.num_steps + 1):  # steps count from 1, as the loop's rows
            f.write(json.dumps({"step": step, "rollout/raw_reward": 0.25 * (step - 1)}) + "\n")
    return "done"


def sleep_until_signalled(cfg, run_dir: Path) -> str:
    """Run until a signal arrives (the cancel test): status must report the job without waiting on it."""
    (run_dir / "started").write_text("")
    while not preempt.requested():
        time.sleep(0.2)
    return "preempted"


def preempt_then_resume(cfg, run_dir: Path) -> str:
    """First start: 'train' until the time-limit signal, write a checkpoint, return "preempted".
    Requeued start: must run with resume=auto, find the checkpoint and finish."""
    marker = run_dir / "checkpoint.json"
    starts = json.loads(marker.read_text())["starts"] if marker.exists() else 0
    if starts == 0:
        (run_dir / "started").write_text("")
        while not preempt.requested():
            time.sleep(0.2)
        marker.write_text(json.dumps({"starts": 1, "signal": preempt.signal_name(), "resume": cfg.resume}))
        return "preempted"
    (run_dir / "resumed.json").write_text(json.dumps({"starts": starts + 1, "resume": cfg.resume,
                                                      "job_id": os.environ.get("SLURM_JOB_ID")}))
    return "done"


def crash(cfg, run_dir: Path) -> str:
    """Fail inside the job (after pre-flight accepted it): status must show FAILED with this message."""
    raise RuntimeError("deliberate crash in the job body")
