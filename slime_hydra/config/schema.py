"""The root config: one slice per group, plus the run-level settings that belong to no group.

Code receives these dataclasses (``OmegaConf.to_object`` once, in launch), never a raw DictConfig, and each
component is handed only its own slice (``cfg.rollout``, ``cfg.train`` ...).
"""

from dataclasses import dataclass, field
from typing import Optional

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.data.config import DataConfig
from slime_hydra.model.config import ModelConfig
from slime_hydra.reward.config import RewardConfig
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.tracking.config import TrackingConfig
from slime_hydra.train.config import TrainConfig


@dataclass
class DebugConfig:
    mode: str = "none"
    """none | rollout_only (generate and score, never train) | train_only (train from saved rollouts, no engines)."""
    rollout_path: Optional[str] = None
    """train_only: directory of rollouts saved by an earlier run (save_rollouts=true)."""
    save_rollouts: bool = False
    """Write every rollout batch to <run_dir>/rollouts/step_<k>.jsonl (the input of train_only)."""


@dataclass
class SlimeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    num_steps: int = 200
    """Rollout steps to run (each: generate -> score -> filter -> train -> sync)."""
    seed: int = 42
    """Seed of model init, sampling and everything else random."""
    mode: str = "sync"
    """sync (generate, then train) | async (generation of step k+1 overlaps training of step k)."""
    max_staleness: int = 1
    """async: a sample may be at most this many weight versions older than the trainer."""
    sync_every_steps: int = 1
    """Push trainer weights to the engines every N rollout steps."""
    save_every_steps: int = 0
    """Checkpoint every N rollout steps (and on SIGTERM/SIGUSR1); 0 saves only at the end and on signals."""
    resume: str = "auto"
    """auto (continue from the newest checkpoint in the run dir, if any) | never | a checkpoint directory."""
    output_dir: str = "runs"
    """Parent directory of run directories (relative to where launch.py is started)."""
    run_name: Optional[str] = None
    """Run directory name under output_dir; null means <model>-<algo>-<timestamp>."""
    dry_run: bool = False
    """Validate, print the resolved config, derived values and the plan, then exit having started nothing."""
