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


def build_optimizer(params, train: TrainConfig, total_steps: int, peak: float | None = None, shard_group=None,
                    part_groups=None):
    """AdamW and a LambdaLR scheduler following ``lr_at``.

    ``shard_group``: a process group whose ranks hold identical parameters and gradients (data-parallel peers);
    with more than one rank the Adam state is sharded over it (ZeRO stage 1: torch's ZeroRedundancyOptimizer
    gives each parameter one owner rank, which alone keeps its state and updates it, then broadcasts it to the
    others). AdamW is fused on CUDA, except under ZeRO: loading a checkpoint puts its step counters on the host,
    which the fused kernel does not accept (the multi-tensor ``foreach`` kernel does).

    ``part_groups``: [(parameters, group)] of parameters identical on another group of ranks than the rest
    (expert parallelism: a rank's experts, identical only on the ranks holding the same experts): a
    ``Partitioned`` optimizer whose first part holds the other trainable ``params`` (sharded over ``shard_group``)
    and each further part one listed set with trainable parameters (sharded over its own group; None: not
    sharded)."""
    peak = train.lr if peak is None else peak
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=peak, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                  weight_decay=train.weight_decay)
    if part_groups is None:
        optimizer = _adamw(params, shard_group, kwargs)
    else:
        listed = {id(p) for subset, _ in part_groups for p in subset}
        parts = [_adamw([p for p in params if id(p) not in listed], shard_group, kwargs)]
        for subset, group in part_groups:
            trained = [p for p in subset if p.requires_grad]
            if trained:
                parts.append(_adamw(trained, group, kwargs))
        optimizer = Partitioned(parts)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, train, total_steps, peak) / peak)
    return optimizer, scheduler


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Load a checkpoint's scheduler ``state`` (the optimizer steps taken) and go on with this run's schedule from
    there: the next optimizer step's learning rate is ``lr_at`` of this run's config. LambdaLR's own load alone keeps
    the checkpoint's peak and its last learning rate, so a resume that changed the schedule (resume_allow_changes)
    took one more step at the old rate and then the new curve scaled by the old peak. An unchanged schedule gets the
    same numbers either way (the same product, base * lambda(step))."""
    peaks = list(scheduler.base_lrs)  # this run's: build_optimizer's peak
    scheduler.load_state_dict(state)
    scheduler.base_lrs = peaks
    scheduler.last_epoch -= 1
    scheduler.step()  # every group's lr (and get_last_lr) from this schedule, at the step the checkpoint reached


def _adamw(params: list, shard_group, kwargs: dict) -> torch.optim.Optimizer:
    """AdamW over ``params``, its state sharded over ``shard_group`` when that has more than one rank."""
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=shard_group, **kwargs)
    fused = torch.cuda.is_available() and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def clip_and_step(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], norm: torch.Tensor,
                  max_norm: float) -> None:
    """The optimizer step on clipped gradients: each of ``grads`` times coef = min(1, max_norm / (norm + 1e-6)), as
    torch's clip_grad_norm_ (max_norm <= 0: no clipping); ``norm`` is their global norm, a device tensor (no sync).

    An optimizer that takes AMP's gradient scale (torch's fused AdamW: ``_step_supports_amp_scaling``) gets 1 / coef
    as its ``grad_scale``, the protocol torch.amp.GradScaler uses, and divides each gradient by it inside its own
    kernel, which writes the scaled gradients back. That replaces a separate multi-tensor multiply (a read and a
    write of every fp32 gradient) by a write: on one H200 with a 0.5B model the multiply took 1.1 ms a step and the
    AdamW kernel 0.5 ms more. Any other optimizer (ZeRO, the multi-tensor AdamW) gets the multiply first."""
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale = coef.reciprocal()
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale
            return
        torch._foreach_mul_(grads, coef)
    optimizer.step()


class Partitioned(torch.optim.Optimizer):
    """One optimizer made of ``parts``, optimizers over disjoint parameter sets whose states are sharded over
    different groups (build_optimizer's ``part_groups``). Its ``param_groups`` are copies of every part's in turn:
    the learning-rate schedule sets them, and ``step`` hands their hyperparameters to each part before stepping it.
    ``state_dict`` is every part's (a ZeroRedundancyOptimizer's only where ``consolidate`` gathered it)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = list(parts)
        super().__init__([dict(group) for part in self.parts for group in part.param_groups], self.parts[0].defaults)

    def sync_parts(self) -> None:
        """The schedule's hyperparameters (lr) from this optimizer's param_groups into every part's."""
        ours = iter(self.param_groups)
        for part in self.parts:
            for group in part.param_groups:
                group.update((k, v) for k, v in next(ours).items() if k != "params")

    @torch.no_grad()
    def step(self, closure=None):
        self.sync_parts()
        for part in self.parts:
            part.step()

    def state_dict(self) -> dict:
        self.sync_parts()
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for part, state in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(state)
        ours = iter(self.param_groups)  # the saved hyperparameters (lr) back into the groups the schedule sets
        for part in self.parts:
            for group in part.param_groups:
                next(ours).update((k, v) for k, v in group.items() if k != "params")


def optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers ``optimizer`` steps: a Partitioned one's parts, else itself."""
    return optimizer.parts if isinstance(optimizer, Partitioned) else [optimizer]


def local_states(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The per-parameter state dicts this rank holds (a ZeroRedundancyOptimizer's: its shard's)."""
    return [state for part in optimizers(optimizer) for state in getattr(part, "optim", part).state.values()]


def consolidate(optimizer: torch.optim.Optimizer) -> None:
    """Every ZeroRedundancyOptimizer's shards gathered on rank 0 of its group, so its ``state_dict`` is readable
    there. Collective over those groups."""
    if isinstance(optimizer, Partitioned):
        optimizer.sync_parts()  # the gathered state carries the current lr
    for part in optimizers(optimizer):
        if isinstance(part, ZeroRedundancyOptimizer):
            part.consolidate_state_dict(to=0)


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any of its state is sharded over peers (ZeRO)."""
    return any(isinstance(part, ZeroRedundancyOptimizer) for part in optimizers(optimizer))
