"""SLURM job shape from the config: one dict that feeds submitit's executor and the dry-run sbatch rendering."""

import shlex
import sys
from pathlib import Path
from typing import Any

from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.config.derive import Derived


def sbatch_parameters(cluster: ClusterConfig, derived: Derived, job_name: str) -> dict[str, Any]:
    """submitit SlurmExecutor parameters: one task per node (it starts Ray there), nodes derived, never typed."""
    extra: dict[str, Any] = {}
    for line in cluster.sbatch_extra:
        key, _, value = line.removeprefix("--").partition("=")
        extra[key.replace("-", "_")] = value if value else True
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": derived.nodes,
        "ntasks_per_node": 1,
        "time": cluster.time_min,
        "setup": list(cluster.setup),
        "additional_parameters": extra,
    }
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    optional = {"partition": cluster.partition, "account": cluster.account, "qos": cluster.qos,
                "constraint": cluster.constraint, "cpus_per_task": cluster.cpus_per_node,
                "mem": f"{cluster.mem_gb}GB" if cluster.mem_gb else None, "exclusive": cluster.exclusive or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def render_sbatch(cluster: ClusterConfig, derived: Derived, job_name: str, folder: Path) -> str:
    """The sbatch script submitit would write for this job (shown by dry_run=true; nothing is submitted)."""
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's own renderer, pinned at 1.5.4

    command = " ".join(shlex.quote(p) for p in (sys.executable, "-u", "-m", "submitit.core._submit", str(folder)))
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cluster, derived, job_name))
