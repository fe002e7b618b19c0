"""Everything a launch checks before anything starts, in one place: launch() and every point of a sweep ask it.

    check = preflight(cfg)
    check.refused(dry_run)     the problems that stop this launch (exit 2)
    check.warnings(dry_run)    the file problems a dry run of a SLURM config only warns about
    check.derived, check.notes the derived values (valid configs), what the data scan found

In order: field domains, group checks, cross-group rules, plug-ins imported (config/rules.collect_problems); the
dataset files read as the run reads them (config/datasets.py); a custom reward called once on the data's first row
(config/plugins.check_reward_call, once the above hold); then the paths (config/files.py): a SLURM config names
shared storage that may exist only where the job runs, so its dry run warns about them and anything else refuses.
"""

from dataclasses import dataclass, field
from typing import Optional

from slime_hydra.config.datasets import check_datasets
from slime_hydra.config.derive import Derived
from slime_hydra.config.files import check_files
from slime_hydra.config.plugins import check_reward_call
from slime_hydra.config.rules import collect_problems
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem


@dataclass
class Preflight:
    cfg: SlimeConfig
    problems: list[Problem]
    """What refuses the launch, dry run or not."""
    file_problems: list[Problem]
    """Paths that are not as the run needs them (config/files.py)."""
    derived: Optional[Derived]
    """The derived values, when the counts allow computing them."""
    notes: list[str] = field(default_factory=list)
    """What the dataset scan found that the run will skip or drop."""

    def lenient(self, dry_run: bool) -> bool:
        return dry_run and self.cfg.cluster.scheduler == "slurm"

    def refused(self, dry_run: bool) -> list[Problem]:
        return self.problems + ([] if self.lenient(dry_run) else self.file_problems)

    def warnings(self, dry_run: bool) -> list[Problem]:
        return self.file_problems if self.lenient(dry_run) else []


def preflight(cfg: SlimeConfig) -> Preflight:
    problems, derived = collect_problems(cfg)
    notes: list[str] = []
    first_rows: dict[str, tuple] = {}
    problems += check_datasets(cfg, notes, first_rows)  # files that are here are read, dry run or not
    if not problems:  # the reward's module imported and the data has rows
        problems += check_reward_call(cfg, first_rows)
    return Preflight(cfg, problems, list(check_files(cfg)), derived, notes)
