"""Train group schema: backend, parallelism, batch sizes in samples, optimizer, weight sync.

Batch arithmetic (checked in config/rules.py, derived in config/derive.py):
  rollout.batch_prompts * rollout.n_samples_per_prompt = global_batch_samples * optimizer_steps_per_rollout
  dp = num_gpus / (tp * pp * cp);  global_batch_samples % (micro_batch_samples * dp) == 0
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class TrainConfig:
    backend: str = "fsdp"
    """fsdp (torch-native FSDP2 over the HF model) | megatron (megatron-core GPTModel)."""
    num_gpus: int = 1
    """Training ranks (GPUs; on a CPU-only machine, CPU processes)."""
    tp: int = 1
    """Tensor-parallel size (megatron only)."""
    pp: int = 1
    """Pipeline-parallel size (megatron only)."""
    cp: int = 1
    """Context-parallel size (megatron only)."""
    ep: int = 1
    """Expert-parallel size for MoE models (megatron only; divides the data-parallel ranks)."""
    global_batch_samples: Optional[int] = None
    """Samples per optimizer step; null derives it from the rollout batch and optimizer_steps_per_rollout."""
    optimizer_steps_per_rollout: Optional[int] = None
    """Optimizer steps taken on one rollout batch; null derives it (1 when global_batch_samples is null too)."""
    micro_batch_samples: int = 1
    """Samples per forward/backward on one rank (gradient accumulation makes up the rest)."""
    max_tokens_per_gpu: Optional[int] = None
    """Dynamic micro-batching: pack sequences up to this many tokens per forward; null uses micro_batch_samples."""
    lr: float = 1e-6
    """Peak learning rate of the policy."""
    critic_lr: float = 1e-5
    """Peak learning rate of the critic (PPO only)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warmup in optimizer steps."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine (after warmup)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.98
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    dtype: str = "bf16"
    """Compute dtype of training: bf16 | fp32 (CPU runs use fp32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: Optional[bool] = None
    """torch.compile each decoder layer's forward (train=fsdp: HF's decoder layers; train=megatron: each
    TransformerLayer) and the logprob head (fewer, fused kernels; the first steps pay the compile). null: on when
    training on CUDA, off on CPU (inductor's C++ compile is slow there)."""
    cuda_graphs: bool = False
    """With train.compile on CUDA: replay each compiled decoder layer (forward and backward) as a CUDA graph
    (torch.compile mode="reduce-overhead": one launch per layer instead of dozens; +12% on one H100 for a 0.5B
    model, docs/benchmarks.md). One graph is recorded per micro-batch shape; refused when colocated."""
    distributed_optimizer: bool = True
    """train=megatron: shard the Adam state over the data-parallel (and context-parallel) peers, ZeRO stage 1
    (megatron's --use-distributed-optimizer; here torch's ZeroRedundancyOptimizer, train/optim.py). Nothing to
    shard with a single such peer."""
    ref_on_cpu: bool = True
    """Keep the reference policy's weights on the host and swap them in for ref logprobs (no second GPU copy)."""
    weight_sync: str = "auto"
    """auto (tensor when colocated, distributed otherwise) | tensor | distributed | disk."""
    weight_sync_bucket_mb: int = 512
    """Size bound of one weight-sync bucket in MiB."""
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Passthrough Megatron options (argparse destinations), checked against a pinned snapshot of the names."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp
