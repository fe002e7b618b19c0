"""Train group schema: backend, parallelism, batch sizes in samples, optimizer, weight sync.

Batch arithmetic (checked in config/rules.py, derived in config/derive.py):
  rollout.batch_prompts * rollout.n_samples_per_prompt = global_batch_samples * optimizer_steps_per_rollout
  dp = num_gpus / (tp * pp * cp);  global_batch_samples % (micro_batch_samples * dp) == 0
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from slime_hydra.options import choice, non_negative, positive, within

TRAIN_BACKENDS = ("fsdp", "megatron")
"""train.backend: the trainer implementations (train/group.py picks the class)."""
TRAIN_DTYPES = ("bf16", "fp32")
"""train.dtype: compute precision (train/precision.py)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine")
"""train.lr_decay_style: schedules after warmup (train/optim.py)."""
WEIGHT_SYNC_METHODS = ("distributed", "tensor", "disk")
"""How weights reach the engines (train/weight_sync.py); train.weight_sync may also say ``auto``."""


@dataclass
class TrainConfig:
    backend: str = choice("fsdp", TRAIN_BACKENDS)
    """fsdp (torch-native FSDP2 over the HF model) | megatron (megatron-core GPTModel)."""
    num_gpus: int = positive(1)
    """Training ranks (GPUs; on a CPU-only machine, CPU processes)."""
    tp: int = positive(1)
    """Tensor-parallel size (megatron only)."""
    pp: int = positive(1)
    """Pipeline-parallel size (megatron only)."""
    cp: int = positive(1)
    """Context-parallel size (megatron only)."""
    ep: int = positive(1)
    """Expert-parallel size for MoE models (megatron only; divides the data-parallel ranks)."""
    global_batch_samples: Optional[int] = positive(None)
    """Samples per optimizer step; null derives it from the rollout batch and optimizer_steps_per_rollout."""
    optimizer_steps_per_rollout: Optional[int] = positive(None)
    """Optimizer steps taken on one rollout batch; null derives it (1 when global_batch_samples is null too)."""
    micro_batch_samples: int = positive(1)
    """Samples per forward/backward on one rank (gradient accumulation makes up the rest)."""
    max_tokens_per_gpu: Optional[int] = positive(None)
    """Dynamic micro-batching: pack sequences up to this many tokens per forward; null uses micro_batch_samples."""
    lr: float = positive(1e-6)
    """Peak learning rate of the policy."""
    critic_lr: float = positive(1e-5)
    """Peak learning rate of the critic (PPO only)."""
    min_lr: float = non_negative(0.0)
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = non_negative(0)
    """Linear warmup in optimizer steps."""
    lr_decay_style: str = choice("constant", LR_DECAY_STYLES)
    """constant | linear | cosine (after warmup)."""
    weight_decay: float = non_negative(0.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = within(0.9, 0.0, 1.0, high_open=True)
    """AdamW beta1."""
    adam_beta2: float = within(0.98, 0.0, 1.0, high_open=True)
    """AdamW beta2."""
    adam_eps: float = positive(1e-8)
    """AdamW epsilon."""
    clip_grad: float = non_negative(1.0)
    """Global gradient-norm clip; 0 disables."""
    dtype: str = choice("bf16", TRAIN_DTYPES)
    """Compute dtype of training: bf16 | fp32 (CPU runs use fp32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: Optional[bool] = None
    """torch.compile each decoder layer's forward (train=fsdp: HF's decoder layers; train=megatron: each
    TransformerLayer) and the logprob head (fewer, fused kernels; the first steps pay the compile). null: on when
    training on CUDA, off on CPU (inductor's C++ compile is slow there)."""
    compile_eager_numerics: bool = True
    """With train.compile and bf16: the compiled layers round to bf16 after every op, as the engines' eager kernels
    do (inductor's emulate_precision_casts), so the trainer's logprobs are those of the distribution the engines
    sampled from. false lets inductor keep fp32 between fused ops: a little more precise and a different function
    from the engines' (on one H100, the tiny default's train-vs-rollout logprob gap was 0.01 nats per token that
    way, 2e-7 in eager bf16; docs/benchmarks.md)."""
    cuda_graphs: bool = False
    """With train.compile on CUDA: replay each compiled decoder layer (forward and backward) as a CUDA graph
    (torch.compile mode="reduce-overhead": one launch per layer instead of dozens; +12% on one H100 for a 0.5B
    model, docs/benchmarks.md). One graph is recorded per micro-batch shape; refused when colocated."""
    distributed_optimizer: bool = True
    """train=megatron: shard the Adam state over the data-parallel (and context-parallel) peers, ZeRO stage 1
    (megatron's --use-distributed-optimizer; here torch's ZeroRedundancyOptimizer, train/optim.py). Nothing to
    shard with a single such peer."""
    weight_sync: str = choice("auto", ("auto",) + WEIGHT_SYNC_METHODS)
    """auto (tensor when colocated, distributed otherwise) | tensor | distributed | disk."""
    weight_sync_bucket_mb: int = positive(512)
    """Size bound of one weight-sync bucket in MiB."""
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Passthrough Megatron options (argparse destinations), checked against a pinned snapshot of the names."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp
