"""The root config: one slice per group, plus the run-level settings that belong to no group.

Code receives these dataclasses (``OmegaConf.to_object`` once, in launch), never a raw DictConfig, and each
component is handed only its own slice (``cfg.rollout``, ``cfg.train`` ...).
"""

import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.data.config import DataConfig
from slime_hydra.model.config import ModelConfig
from slime_hydra.options import Problem, choice, non_negative, positive
from slime_hydra.reward.config import RewardConfig
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.stall import ON_STALL
from slime_hydra.tracking.config import TrackingConfig
from slime_hydra.train.config import TrainConfig

DEBUG_MODES = ("none", "rollout_only", "train_only")
"""debug.mode: which half of the loop runs (loop.py)."""
MODES = ("sync", "async")
"""mode: whether generation of the next step overlaps training (loop.py)."""


@dataclass
class DebugConfig:
    mode: str = choice("none", DEBUG_MODES)
    """none | rollout_only (generate and score, never train) | train_only (train from saved rollouts, no engines)."""
    rollout_path: Optional[str] = None
    """train_only: directory of rollouts saved by an earlier run (save_rollouts=true)."""
    save_rollouts: bool = False
    """Write every rollout batch to <run_dir>/rollouts/step_<k>.jsonl (the input of train_only)."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.mode == "train_only" and not self.rollout_path:
            yield Problem((f"{prefix}rollout_path",), "debug=train_only trains from saved rollouts",
                          f"set {prefix}rollout_path=<run_dir>/rollouts (written by debug=rollout_only)")


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

    num_steps: int = positive(200)
    """Rollout steps to run (each: generate -> score -> filter -> train -> sync)."""
    seed: int = 42
    """Seed of model init, sampling and everything else random."""
    deterministic: bool = False
    """The same command gives the same run: every request samples from a stream of its own, seeded by (seed, its
    group, its sample, the weight version), on batch-invariant engines (model/invariant.py), so what shares its
    batch changes nothing; a batch's groups train in their index order. metrics.jsonl repeats bit for bit but for
    times and speeds, also across a resume. Sync mode, no over-sampling, embedded engines, CPU."""
    mode: str = choice("sync", MODES)
    """sync (generate, then train) | async (generation of the next steps overlaps training of step k)."""
    max_staleness: int = non_negative(1)
    """async: the rollouts of this many next steps (one at least) are started ahead of the trainer, and a sample is
    at most this many weight versions older than the policy that trains on it."""
    sync_every_steps: int = positive(1)
    """Push trainer weights to the engines every N rollout steps (algo=sft: before each eval instead, the engines'
    only work there)."""
    save_every_steps: int = non_negative(0)
    """Checkpoint every N rollout steps; 0: by time only (save_every_minutes). Always at the end and on
    SIGTERM/SIGUSR1/SIGUSR2."""
    save_every_minutes: float = non_negative(30.0)
    """Also checkpoint after a step that ends this many minutes after the last checkpoint (or the start), so a crash
    loses at most about this much; 0 disables."""
    keep_checkpoints: int = non_negative(3)
    """Keep the newest N checkpoints of the run and delete older ones once a newer one is complete; 0 keeps all."""
    checkpoint_in_background: bool = True
    """The step waits only while the trainer ranks copy their state to host memory; a thread writes the files and
    ``latest`` moves at a later step boundary once all are on disk. Host RAM holds one more copy of the trainer's
    state (weights + Adam state, counted by the memory plan); false writes it while the step waits."""
    export_at_end: bool = True
    """A run that finishes writes its final policy as a Hugging Face checkpoint to <run_dir>/export/step_<N> (merged
    weights in the starting checkpoint's dtype, config, tokenizer; with train.lora also its PEFT adapter in
    adapter/); ``python -m slime_hydra.export RUN_DIR --step N`` writes one of any checkpoint."""
    stall_after_minutes: float = non_negative(30.0)
    """The stall doctor (stall.py): after this many minutes in which no step finished and no generation or reward
    finished, write every process's Python stacks to <run_dir>/stall/ and print what the run waits on; 0 disables."""
    on_stall: str = choice("stop", ON_STALL)
    """stop (end the run with that report) | wait (keep waiting; report again after every further period)."""
    resume: str = "auto"
    """auto (continue from the newest checkpoint in the run dir, if any) | never (a fresh run; in a run dir that holds
    a run, the next free <run dir>-<n> beside it) | a checkpoint directory."""
    resume_allow_changes: bool = False
    """A resume may change the schedule, model, data or algorithm of the run it continues: the changed keys and the
    learning rate's jump are printed. false refuses such a resume with that list (launch/resume.py: FREE_ON_RESUME
    are the keys that may always change)."""
    output_dir: str = "runs"
    """Parent directory of run directories (relative to where launch.py is started)."""
    run_name: Optional[str] = None
    """Run directory name under output_dir; null means <model>-<algo>-<timestamp>."""
    dry_run: bool = False
    """Validate, print the resolved config, derived values and the plan, then exit having started nothing."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """Run-level settings the field domains cannot check (options.py); rules across groups: config/rules.py."""
        if self.run_name is not None and (not re.fullmatch(r"[\w.+=,@-]+", self.run_name)
                                          or set(self.run_name) == {"."}):
            yield Problem(("run_name",),
                          f"{self.run_name!r} is not a plain directory name (letters, digits and . _ - + = , @)",
                          "e.g. run_name=qwen3-grpo-lr1e-6 (the run directory is output_dir/run_name)")
        if self.resume not in ("auto", "never") and not self.resume.strip():
            yield Problem(("resume",), "is empty", "set resume=auto, resume=never or resume=<checkpoint dir>")
