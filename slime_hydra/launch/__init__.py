"""What launch.py does with a composed config: check -> (dry run: print the plan) -> run dir -> run.

    precheck_argv(argv)   nearest-name errors for mistyped override keys, before Hydra composes
    launch(cfg)           the Hydra task function: validate, then plan or run; exit code 2 on a bad config
"""

import os
import sys
from typing import Sequence

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from slime_hydra import preempt
from slime_hydra.cluster.local_ray import set_local_ray_env
from slime_hydra.config import ConfigError, check_overrides, compose, to_config
from slime_hydra.config.advice import advice
from slime_hydra.config.hydra_errors import as_problems
from slime_hydra.config.preflight import preflight
from slime_hydra.launch.plan import plan_text, print_plan
from slime_hydra.launch.resume import check_resume
from slime_hydra.launch.run_dir import run_dir_for, write_provenance
from slime_hydra.launch.sweep import point_run_dir


def _fail(error: ConfigError) -> None:
    print(f"slime_hydra: {error}", file=sys.stderr)
    raise SystemExit(ConfigError.exit_code)


def precheck_argv(argv: Sequence[str]) -> None:
    """Before Hydra runs: every override parses and names a key of the schema (with the nearest valid name), and a
    single run's config composes; Hydra's own errors (a group option that does not exist, a value of the wrong
    type, an unparseable override) are reported in slime_hydra's format too. Exit 2 on any problem."""
    from hydra._internal.utils import get_args_parser  # Hydra's own CLI parser, so flags parse exactly as hydra.main

    args, _ = get_args_parser().parse_known_args(list(argv))
    try:
        problems = check_overrides(args.overrides)
        if not problems and not args.multirun and not args.help and not args.hydra_help:
            to_config(compose(args.overrides))  # hydra.main composes it again: ~0.3 s
    except ConfigError as error:
        problems = error.problems
    except Exception as error:
        problems = as_problems(error, args.overrides)
        if problems is None:
            raise
    if problems:
        _fail(ConfigError(problems))


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def launch(dict_cfg: DictConfig) -> None:
    console = Console(soft_wrap=True)
    try:
        cfg = to_config(dict_cfg)
    except ConfigError as error:
        _fail(error)
    check = preflight(cfg)
    problems, derived = check.refused(cfg.dry_run), check.derived
    point_dir = point_run_dir()  # a sweep point runs in <sweep_dir>/<num>
    run_dir, refused = check_resume(cfg, dict_cfg, point_dir or run_dir_for(cfg), console, point_dir is not None)
    problems += refused  # resume=never beside an earlier run; a resume that changes what the run learns
    if cfg.dry_run:
        console.rule("Resolved config")
        console.print(OmegaConf.to_yaml(dict_cfg, resolve=True), markup=False, highlight=False)
    for problem in check.warnings(cfg.dry_run):  # shared-storage paths may exist only where the job runs
        print(f"slime_hydra: warning: {problem}", file=sys.stderr)
    if problems:
        _fail(ConfigError(problems))
    assert derived is not None
    if cfg.dry_run or not cfg.tracking.quiet:
        print_plan(cfg, derived, run_dir, console)
    for warning in advice(cfg, derived):  # runs, but is likely not what was meant
        print(f"slime_hydra: warning: {warning}", file=sys.stderr)
    for note in check.notes:
        console.print(f"  data: {note}", markup=False)
    if cfg.dry_run:
        console.print("dry run: config valid, nothing started.", markup=False)
        return
    write_provenance(run_dir, dict_cfg, _overrides(), plan_text(cfg, derived, run_dir))
    if cfg.tracking.quiet:
        console.print(f"run directory: {run_dir} (the config in resolved.yaml, the plan in plan.txt)", markup=False)
    if cfg.cluster.scheduler == "slurm":
        from slime_hydra.launch.submit import submit

        submit(cfg, derived, run_dir, _overrides(), console=console)  # non-blocking: prints the job id and returns
        return
    if not os.environ.get("RAY_ADDRESS"):
        set_local_ray_env()  # before loop.py imports ray, which reads it at import
    from slime_hydra.loop import run

    try:
        outcome = run(cfg, run_dir)
    except ConfigError as error:  # what only the run can see: a checkpoint whose checksums do not match
        _fail(error)
    console.print(f"{outcome}: {run_dir}", markup=False)
    if outcome == "preempted":
        raise SystemExit(preempt.EXIT_CODE)
