"""Cluster group schema: where the job runs (local or SLURM) and how Ray is laid over it.

The node count is never typed: it is derived from the GPUs the roles need and ``gpus_per_node``
(config/derive.py). A site writes one ``conf/cluster/<site>.yaml`` with its partition, account and set-up lines.
"""

from dataclasses import dataclass, field
from typing import Iterator, List, Optional

from slime_hydra.options import Problem, choice, non_negative, positive, within

SCHEDULERS = ("local", "slurm")
"""cluster.scheduler: where launch.py runs the job (launch/__init__.py)."""
OFFLOAD_POLICIES = ("auto", "always", "never")
"""cluster.colocate_offload (config/memory.py resolves auto)."""


@dataclass
class ClusterConfig:
    scheduler: str = choice("local", SCHEDULERS)
    """local (this machine, Ray started by launch.py) | slurm (sbatch through submitit)."""
    gpus_per_node: int = non_negative(0)
    """GPUs per node; 0 means a CPU-only machine (each role 'GPU' is then a CPU process)."""
    nodes: Optional[int] = positive(None)
    """CPU-only sites (gpus_per_node=0): how many nodes the role processes spread over, dealt round-robin
    (config/derive.py bundle_nodes); null means 1. GPU sites derive it (ceil(total GPUs / gpus_per_node)): leave it null
    there."""
    cpus_per_node: Optional[int] = positive(None)
    """CPUs given to Ray per node; null means what the machine (or the SLURM allocation) has."""
    colocate: bool = False
    """Training ranks and engines share the same GPUs (engines release memory while the trainer works)."""
    colocate_offload: str = choice("auto", OFFLOAD_POLICIES)
    """Colocated on GPUs, whether memory moves at each switch between generating and training. always: the
    trainer's parameters and optimizer state go to the host while the engines generate, and the engines park their
    weights and drop their KV cache and CUDA graphs while the trainer works. never: both stay resident (no memory
    moves; the engines keep their CUDA graphs), which needs the trainer's and the engines' peaks to fit one GPU
    together. auto: never where the memory plan says they fit in 90% of cluster.gpu_memory_gb, else always."""
    partition: Optional[str] = None
    """slurm: partition (sbatch --partition)."""
    account: Optional[str] = None
    """slurm: account (sbatch --account)."""
    qos: Optional[str] = None
    """slurm: quality of service (sbatch --qos)."""
    constraint: Optional[str] = None
    """slurm: node feature constraint (sbatch --constraint)."""
    exclusive: bool = False
    """slurm: whole nodes (sbatch --exclusive)."""
    time_min: int = positive(60)
    """slurm: wall-clock limit in minutes."""
    mem_gb: Optional[int] = positive(None)
    """Host RAM per node in GiB (slurm: also sbatch --mem); null: the partition's default (local: this machine's).
    The memory plan checks the host side against it."""
    gpu_memory_gb: Optional[float] = positive(None)
    """Memory of one GPU in GiB (80 for an H100 80GB); null: unknown (local: what nvidia-smi reports). The memory
    plan refuses a config whose per-GPU peak exceeds it."""
    sbatch_extra: List[str] = field(default_factory=list)
    """slurm: extra '#SBATCH' option lines, verbatim (e.g. --reservation=rl)."""
    setup: List[str] = field(default_factory=list)
    """slurm: shell lines run before the job (module load, conda activate, container set-up)."""
    ray_port: int = within(6379, 1024, 65535 - 1000)
    """Ray head GCS port (SLURM jobs add job_id % 1000 to avoid clashes between jobs on one node)."""
    ray_wait_nodes_s: int = positive(300)
    """Seconds the driver waits for all nodes to join Ray before failing."""
    job_body: str = "slime_hydra.loop.run"
    """slurm: dotted path of the function rank 0 runs as the Ray driver, body(cfg, run_dir) -> "done" | "preempted"."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        for k, line in enumerate(self.sbatch_extra):
            if "\n" in line or "\r" in line:
                yield Problem((f"{prefix}sbatch_extra",),
                              f"entry {k} ({line!r}) spans lines: each entry becomes one '#SBATCH' line, and a line "
                              "break would start another directive or a shell command",
                              f"one option per entry, e.g. {prefix}sbatch_extra=['--reservation=rl','--comment=x']")
