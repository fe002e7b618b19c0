"""AdamW and the learning-rate schedule shared by the training backends.

    lr(step) = lr * step / warmup                          for step < warmup (linear warmup)
             = min_lr + (lr - min_lr) * decay(progress)    after, progress = (step - warmup) / (total - warmup)
    decay: constant -> 1; linear -> 1 - progress; cosine -> (1 + cos(pi * progress)) / 2
"""

import math

import torch

from slime_hydra.train.config import TrainConfig


def lr_at(step: int, train: TrainConfig, total_steps: int, peak: float | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``."""
    peak = train.lr if peak is None else peak
    if step < train.lr_warmup_steps:
        return peak * (step + 1) / train.lr_warmup_steps
    if train.lr_decay_style == "constant":
        return peak
    span = max(total_steps - train.lr_warmup_steps, 1)
    progress = min((step - train.lr_warmup_steps) / span, 1.0)
    decay = 1 - progress if train.lr_decay_style == "linear" else (1 + math.cos(math.pi * progress)) / 2
    return train.min_lr + (peak - train.min_lr) * decay


def build_optimizer(params, train: TrainConfig, total_steps: int, peak: float | None = None):
    """AdamW (fused on CUDA) and a LambdaLR scheduler following ``lr_at``."""
    peak = train.lr if peak is None else peak
    params = [p for p in params if p.requires_grad]
    fused = torch.cuda.is_available() and all(p.is_cuda for p in params)
    optimizer = torch.optim.AdamW(params, lr=peak, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                  weight_decay=train.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, train, total_steps, peak) / peak)
    return optimizer, scheduler
