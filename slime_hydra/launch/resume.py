"""What a launch may do to the run it continues: resume=never takes a directory of its own, and a resume keeps the
schedule, model, data and algorithm of the run it resumes.

    check_resume(cfg, resolved, run_dir, console, sweep_point) -> (run_dir, problems)   launch(), before the plan

``resume=never`` in a directory that holds a run (run_dir.holds_run: its resolved.yaml, metrics.jsonl or
checkpoints) runs in the next free ``<name>-<n>`` beside it and says so; the old directory is not touched. A sweep
point's directory is fixed by the sweep's manifest, so there it is a problem (a new ``hydra.sweep.dir``).

A resume (``resume=auto`` finding checkpoints/latest, or ``resume=<checkpoint dir>``) is compared key by key with
the top-level resolved.yaml of the run the checkpoint belongs to (its latest launch, launch/run_dir.py). Keys that
say where and how the run executes, what it records and when it saves may change (``FREE_ON_RESUME``). Any other
change is listed (``key: old -> new``, one per line) and refused with exit 2, dry runs included, unless
``resume_allow_changes=true``: the checkpoint continues a run planned with the old values, and a change there is
silent otherwise (a longer num_steps stretched the learning-rate decay, and the rate jumped from 2e-5 to 7.4e-5).
``num_steps`` counts as schedule when the rate decays (``train.lr_decay_style`` linear or cosine: num_steps x
optimizer steps per rollout is the decay's horizon, train/optim.py); with a constant rate it only says where the
run stops, and extending the run is free. Allowed changes are listed with the learning rate's jump at the resumed
step (the trainer goes on along the new schedule from there: train/optim.continue_schedule). Keys only one side
has (the schema changed between the launches) are not compared. A resume with no checkpoint to take (none intact,
or ``resume=<dir>`` naming no checkpoint) is refused by checkpoint.checkpoint_problems (sizes only: the loop
verifies the checksums when it starts, and prints the checkpoints it passes over).
"""

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from slime_hydra.checkpoint import checkpoint_problems, find_resume
from slime_hydra.config import load_run_config
from slime_hydra.config.derive import derive
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.launch.run_dir import holds_run, unused_sibling
from slime_hydra.options import Problem

FREE_ON_RESUME = (
    # where and how the run executes (a checkpoint that cannot load at another layout says so when it loads)
    "cluster.", "rollout.num_gpus", "rollout.gpus_per_engine", "rollout.max_concurrency_per_engine",
    "rollout.router_policy", "rollout.health_check_interval_s", "rollout.max_generate_retries", "train.num_gpus",
    "train.tp", "train.pp", "train.cp", "train.ep", "train.micro_batch_samples", "train.max_tokens_per_gpu",
    "train.pack_sequences", "train.gradient_checkpointing", "train.compile", "train.cuda_graphs",
    "train.distributed_optimizer", "train.weight_sync", "train.weight_sync_bucket_mb", "reward.url",
    "reward.timeout_s", "reward.max_concurrency", "reward.max_retries", "reward.backoff_s",
    # what it records, when it evaluates and saves, how it watches itself
    "tracking.", "rollout.eval_every_steps", "debug.save_rollouts", "save_every_steps", "save_every_minutes",
    "keep_checkpoints", "checkpoint_in_background", "export_at_end", "stall_after_minutes", "on_stall",
    # the launch itself
    "resume", "resume_allow_changes", "output_dir", "run_name", "dry_run",
)
"""Keys a resume may change (a trailing '.': every key of the group); num_steps too when the learning rate is
constant. Every other key is the schedule, model, data or algorithm of the run (module docstring)."""
_ABSENT = object()


def schema_keys(schema: type = SlimeConfig, prefix: str = "") -> Iterator[str]:
    """The dotted keys of a schema, through its nested groups; a dict or list field is one key."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from schema_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}"


def _get(config: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return _ABSENT
        config = config[part]
    return config


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every schema key both configs have and whose values differ."""
    changes = []
    for key in schema_keys():
        before, after = _get(old, key), _get(new, key)
        if before is not _ABSENT and after is not _ABSENT and before != after:
            changes.append((key, before, after))
    return changes


def free_on_resume(key: str, old: dict, new: dict) -> bool:
    """Whether a resume may change ``key`` (FREE_ON_RESUME; num_steps while the learning rate is constant)."""
    if key == "num_steps":
        return _get(old, "train.lr_decay_style") == _get(new, "train.lr_decay_style") == "constant"
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_ON_RESUME)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def lr_jump(old: SlimeConfig, new: SlimeConfig, step: int) -> str:
    """The learning rate of the first optimizer step of rollout step ``step + 1``, the first after a resume from the
    checkpoint of step ``step``: under the schedule the run was planned with, and under the new one, which the trainer
    follows (train/optim.continue_schedule)."""
    from slime_hydra.train.optim import lr_at  # torch: imported only here

    done = step * derive(old).optimizer_steps_per_rollout  # the optimizer steps the checkpoint has taken

    def rates(cfg: SlimeConfig) -> tuple[float, float]:
        total = cfg.num_steps * derive(cfg).optimizer_steps_per_rollout
        return lr_at(done, cfg.train, total), lr_at(done, cfg.train, total, peak=cfg.train.critic_lr)

    (actor, critic), (new_actor, new_critic) = rates(old), rates(new)
    text = f"the learning rate at step {step + 1}: {actor:.3g} -> {new_actor:.3g}"
    return text + (f" (critic: {critic:.3g} -> {new_critic:.3g})" if new.algo.needs_critic else "")


def check_resume(cfg: SlimeConfig, resolved: DictConfig, run_dir: Path, console: Console,
                 sweep_point: bool = False) -> tuple[Path, list[Problem]]:
    """The run directory this launch uses, and the problems of its resume (module docstring). Reads only."""
    if cfg.resume == "never":
        if not holds_run(run_dir):
            return run_dir, []
        if sweep_point:
            return run_dir, [Problem(("resume",), f"resume=never, but this sweep point's run dir {run_dir} holds a run",
                                     "set hydra.sweep.dir=<a new directory>, or resume=auto to continue those runs")]
        fresh = unused_sibling(run_dir)
        console.print(f"resume=never: {run_dir} holds a run and is left as it is; this run goes to {fresh}",
                      markup=False, highlight=False)
        return fresh, []
    problems = checkpoint_problems(cfg.resume, run_dir)  # sizes only: a stat per file; the loop checks the CRCs
    if problems:  # resume=<dir> that is no checkpoint, or checkpoints there but none intact
        return run_dir, problems
    ckpt = find_resume(cfg.resume, run_dir, checksums=False, quiet=True)
    if ckpt is None:
        return run_dir, []
    planned = Path(ckpt).resolve().parents[1] / "resolved.yaml"  # <run>/checkpoints/step_N -> <run>
    if not planned.is_file():
        console.print(f"resume: {ckpt} has no run config beside it ({planned} is missing): the resume is not "
                      "compared with the run it continues", markup=False, highlight=False)
        return run_dir, []
    old = OmegaConf.to_container(OmegaConf.load(planned))
    new = OmegaConf.to_container(resolved, resolve=True)
    changed = [(key, a, b) for key, a, b in config_changes(old, new) if not free_on_resume(key, old, new)]
    if not changed:
        return run_dir, []
    diff = [f"  {key}: {_show(a)} -> {_show(b)}" for key, a, b in changed]
    if not cfg.resume_allow_changes:
        print(f"resume from {ckpt}: {len(changed)} key(s) differ from the run's config ({planned}):", *diff,
              sep="\n", file=sys.stderr)
        return run_dir, [Problem(tuple(key for key, _, _ in changed),
                                 "changed on resume (listed above): the checkpoint continues a run whose schedule, "
                                 "model, data and algorithm were planned with the old values",
                                 "keep the old values, start a new run (resume=never, or another run_name), or allow "
                                 "the change with resume_allow_changes=true")]
    step = json.loads((Path(ckpt) / "loop.json").read_text())["step"]
    try:
        jump = lr_jump(load_run_config(planned.parent), cfg, step)
    except Exception as error:  # an old config this schema no longer reads: the changes are listed all the same
        jump = f"the learning rate at step {step + 1}: not computed ({type(error).__name__}: {error})"
    console.print("\n".join([f"resume from {ckpt} with resume_allow_changes=true: {len(changed)} key(s) differ "
                             f"from the run's config ({planned}):", *diff, f"  {jump}"]), markup=False, highlight=False)
    return run_dir, []
