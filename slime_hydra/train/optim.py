"""AdamW and the learning-rate schedule shared by the training backends.

    lr(step) = lr * step / warmup                          for step < warmup (linear warmup)
             = min_lr + (lr - min_lr) * decay(progress)    after, progress = (step - warmup) / (total - warmup)
    decay: constant -> 1; linear -> 1 - progress; cosine -> (1 + cos(pi * progress)) / 2
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from slime_hydra.train.config import TrainConfig

DECAY = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: (1.0 + math.cos(math.pi * progress)) / 2.0,
}
"""train.lr_decay_style (train/config.LR_DECAY_STYLES) -> decay(progress in [0, 1])."""


def lr_at(step: int, train: TrainConfig, total_steps: int, peak: float | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``."""
    peak = train.lr if peak is None else peak
    if step < train.lr_warmup_steps:
        return peak * (step + 1) / train.lr_warmup_steps
    if train.lr_decay_style == "constant":
        return peak
    span = max(total_steps - train.lr_warmup_steps, 1)
    progress = min((step - train.lr_warmup_steps) / span, 1.0)
    return train.min_lr + (peak - train.min_lr) * DECAY[train.lr_decay_style](progress)


def build_optimizer(params, train: TrainConfig, total_steps: int, peak: float | None = None, shard_group=None):
    """AdamW and a LambdaLR scheduler following ``lr_at``.

    ``shard_group``: a process group whose ranks hold identical parameters and gradients (data-parallel peers);
    with more than one rank the Adam state is sharded over it (ZeRO stage 1: torch's ZeroRedundancyOptimizer
    gives each parameter one owner rank, which alone keeps its state and updates it, then broadcasts it to the
    others). AdamW is fused on CUDA, except under ZeRO: loading a checkpoint puts its step counters on the host,
    which the fused kernel does not accept (the multi-tensor ``foreach`` kernel does)."""
    peak = train.lr if peak is None else peak
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=peak, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                  weight_decay=train.weight_decay)
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=shard_group,
                                            **kwargs)
    else:
        fused = torch.cuda.is_available() and all(p.is_cuda for p in params)
        optimizer = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, train, total_steps, peak) / peak)
    return optimizer, scheduler
