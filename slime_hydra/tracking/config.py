"""Tracking group schema: where metrics go. metrics.jsonl in the run directory is always written."""

from dataclasses import dataclass, field
from typing import List, Optional

from slime_hydra.options import positive


@dataclass
class TrackingConfig:
    wandb: bool = False
    """Log to Weights & Biases (offline when no WANDB_API_KEY, online otherwise)."""
    wandb_project: str = "slime_hydra"
    """wandb project."""
    wandb_entity: Optional[str] = None
    """wandb entity (team); null means the key's default."""
    wandb_group: Optional[str] = None
    """wandb group (sweeps set it to the sweep name); null means none."""
    tags: List[str] = field(default_factory=list)
    """Tags attached to the run."""
    tensorboard: bool = False
    """Write TensorBoard event files under <run_dir>/tensorboard."""
    progress: bool = True
    """Show the rich progress display on the terminal."""
    quiet: bool = False
    """Before a run, print one line (the run directory) instead of the derived values, the plan and the memory plan;
    the run directory's plan.txt and resolved.yaml hold them either way. Dry runs print everything."""
    log_every_steps: int = positive(1)
    """Metrics are emitted every N rollout steps."""
