"""Reductions under a loss mask, shared by the advantage estimators and the losses.

A mask is [B, T], float or bool; a nonzero entry marks a trained response token, zero marks padding or a token
the policy did not produce (tool output). Masked entries are *selected away* with ``torch.where`` rather than
multiplied by 0, so a NaN or inf sitting in a padded slot (e.g. a logprob of a pad token) never reaches a result
or a gradient.
"""

from typing import Optional

import torch


def as_bool_mask(loss_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``loss_mask != 0`` as bool, checked to have the shape of ``like``."""
    if loss_mask.shape != like.shape:
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(like.shape)}")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def masked_fill_zero(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``x`` where the mask is nonzero, exactly 0 elsewhere (gradient 0 at masked slots)."""
    mask = as_bool_mask(loss_mask, x)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, loss_mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum_t m_t x_t over ``dim`` (all elements when None)."""
    x = masked_fill_zero(x, loss_mask)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_count(loss_mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Number of trained tokens over ``dim`` (all elements when None), as float."""
    m = (loss_mask != 0).float() if loss_mask.dtype != torch.bool else loss_mask.float()
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: torch.Tensor, loss_mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum_t m_t x_t / sum_t m_t over ``dim`` (all elements when None); 0 where no token is trained (never NaN)."""
    total = masked_sum(x, loss_mask, dim)
    count = masked_count(loss_mask, dim).to(total.dtype)
    return total / torch.where(count > 0, count, torch.ones_like(count))
