"""The plan a run would execute, printed by dry_run=true: derived values, Ray placement, the sbatch script."""

import io
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slime_hydra.config.derive import Derived, gpu_hours_for, node_roles
from slime_hydra.config.memory import plan_memory
from slime_hydra.dotted import import_callable
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.config.schema import SlimeConfig


MAX_LISTED = 1024
"""The dry run lists what runs on each node up to this many placement bundles."""


def derived_table(cfg: SlimeConfig, d: Derived) -> Table:
    unit = "GPUs" if cfg.cluster.gpus_per_node else "CPU processes"
    t, r = cfg.train, cfg.rollout
    table = Table(title="Derived values", show_lines=False)
    table.add_column("value")
    table.add_column("=", justify="right")
    table.add_column("from")
    rows = [
        ("samples per rollout", d.samples_per_rollout,
         f"rollout.batch_prompts({r.batch_prompts}) x rollout.n_samples_per_prompt({r.n_samples_per_prompt})"),
        ("global batch (samples)", d.global_batch_samples,
         "train.global_batch_samples" if t.global_batch_samples else "samples per rollout / optimizer steps"),
        ("optimizer steps per rollout", d.optimizer_steps_per_rollout,
         "train.optimizer_steps_per_rollout" if t.optimizer_steps_per_rollout else "samples per rollout / global batch"),
        ("data-parallel size (dp)", d.dp, f"train.num_gpus({t.num_gpus}) / (tp {t.tp} x pp {t.pp} x cp {t.cp})"),
        ("gradient accumulation", d.grad_accum_steps, f"global batch / (micro_batch_samples {t.micro_batch_samples} x dp)"),
        (f"train {unit}", d.train_gpus, "train.num_gpus"),
        (f"rollout {unit}", d.rollout_gpus, "rollout.num_gpus" + (" (colocated)" if cfg.cluster.colocate else "")),
        ("engines", d.num_engines, f"rollout {unit} / rollout.gpus_per_engine({r.gpus_per_engine})"),
        (f"total {unit}", d.total_gpus, "max(train, rollout)" if cfg.cluster.colocate else "train + rollout"),
        ("nodes", d.nodes, f"ceil(total / cluster.gpus_per_node={cfg.cluster.gpus_per_node})"
         if cfg.cluster.gpus_per_node else
         f"cluster.nodes={cfg.cluster.nodes}" if cfg.cluster.nodes else "this machine"),
        ("context (tokens)", d.context_tokens, "data.max_prompt_tokens + rollout.max_response_tokens"),
        ("weight sync", d.weight_sync, f"train.weight_sync={t.weight_sync}"
         + (" (colocated: tensor for embedded engines, disk for SGLang; else distributed)"
            if t.weight_sync == "auto" else "")),
        ("engine dtype", d.engine_dtype, f"train.dtype={t.dtype} on {'GPUs' if cfg.cluster.gpus_per_node else 'CPU'}"),
    ]
    if cfg.cluster.scheduler == "slurm" and cfg.cluster.gpus_per_node:
        rows.append(("GPU-hours reserved", f"{gpu_hours_for(d, cfg.cluster.time_min):.1f}",
                     f"nodes x gpus_per_node x cluster.time_min({cfg.cluster.time_min}) / 60"))
    for name, value, source in rows:
        table.add_row(name, str(value), source)
    return table


def placement_lines(cfg: SlimeConfig, d: Derived) -> list[str]:
    """Ray placement groups: one bundle per GPU (per CPU process on a CPU-only machine)."""
    gpu = cfg.cluster.gpus_per_node > 0
    bundle = "{GPU: 1, CPU: 1}" if gpu else "{CPU: 1}"
    mode = "colocated (engines and trainer share bundles)" if cfg.cluster.colocate else "disaggregated"
    lines = [
        f"Ray on {d.nodes} node(s), {mode}, {cfg.mode} mode, weight sync: {d.weight_sync}",
        f"  placement group 'train': {d.train_gpus} x {bundle} -> {d.train_gpus} {cfg.train.backend} rank actor(s), "
        f"dp={d.dp} tp={cfg.train.tp} pp={cfg.train.pp} cp={cfg.train.cp}"
        + (f", each holding the teacher {cfg.algo.teacher.path} (frozen)" if cfg.algo.distills else ""),
    ]
    if cfg.debug.mode != "train_only":
        where = "the 'train' bundles" if cfg.cluster.colocate else f"placement group 'rollout': {d.rollout_gpus} x {bundle}"
        lines.append(f"  {where} -> {d.num_engines} {cfg.rollout.backend} engine(s) of "
                     f"{cfg.rollout.gpus_per_engine}{', batch-invariant' if d.batch_invariant_engines else ''}, "
                     f"behind sglang-router ({cfg.rollout.router_policy})")
        lines.append("  rollout manager actor: data source, buffer, reward "
                     f"'{cfg.reward.name}', router; {cfg.num_steps} rollout steps")
    if d.nodes > 1 and d.total_gpus > MAX_LISTED:
        lines.append(f"  {d.total_gpus} bundles over {d.nodes} nodes: too many to list one by one")
    elif d.nodes > 1:
        for k, roles in enumerate(node_roles(cfg, d)):
            head = " (Ray head: driver, rollout manager, router)" if k == 0 else ""
            lines.append(f"  node {k + 1}{head}: {', '.join(roles) or 'nothing'}")
    return lines


def plan_text(cfg: SlimeConfig, d: Derived, run_dir: Path) -> str:
    """What ``print_plan`` shows, as plain text 120 columns wide: <run_dir>/plan.txt."""
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    print_plan(cfg, d, run_dir, console)
    return console.export_text()


def print_plan(cfg: SlimeConfig, d: Derived, run_dir: Path, console: Console) -> None:
    console.print(derived_table(cfg, d))
    console.rule("Plan")
    for line in placement_lines(cfg, d):
        console.print(line, markup=False, highlight=False)
    console.print(f"  run directory: {run_dir}", markup=False, highlight=False)
    console.print("Memory plan (estimates, config/memory.py):", markup=False, highlight=False)
    for line in plan_memory(cfg, d).lines():
        console.print(f"  {line}", markup=False, highlight=False)
    kind = ENGINE_KINDS[cfg.rollout.backend]
    if kind.commands is not None and cfg.debug.mode != "train_only":
        console.rule(f"{kind.name} engine commands (host and ports are picked at start)")
        for line in import_callable(kind.commands, "engine kind commands", "fn(cfg, derived)")(cfg, d):
            console.print(line, markup=False, highlight=False)
    if cfg.cluster.scheduler == "slurm":
        from slime_hydra.launch.slurm import render_sbatch

        console.rule("sbatch script (not submitted)")
        script = render_sbatch(cfg.cluster, d, run_dir.name, run_dir / "slurm")
        console.print(script, markup=False, highlight=False)
