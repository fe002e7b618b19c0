"""train/optim.py: the learning-rate schedule, the Partitioned optimizer (expert parallelism's two ZeRO parts)
against one AdamW over the same parameters, in one process (parts unsharded: their ZeRO form runs in
tests/train/test_megatron_moe.py's four-rank cases), and clip_and_step against torch's clip_grad_norm_."""

import copy
import dataclasses
import math

import pytest
import torch

from slime_hydra.train.config import TrainConfig
from slime_hydra.train.optim import (Partitioned, build_optimizer, clip_and_step, continue_schedule, local_states,
                                     lr_at, optimizers)

TRAIN = TrainConfig(lr=1e-2, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-3, weight_decay=0.1)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (3,), (5, 2), (2,))]


def _steps(params, optimizer, scheduler, n: int, seed: int) -> list[float]:
    """n steps on fixed random gradients; the learning rate each used."""
    g, lrs = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return lrs


def test_partitioned_steps_and_resumes_like_one_adamw():
    """Two parts (the second: the "experts" p[2], p[3]) under warmup + cosine decay take the same steps as one AdamW
    bit for bit, each part holding state for its own parameters only; a state dict taken after 3 of 6 steps (the
    learning rate already moved on) loads into a fresh optimizer that takes the last 3 steps alike."""
    whole, split = _params(), _params()
    one, one_schedule = build_optimizer(whole, TRAIN, total_steps=6)
    two, two_schedule = build_optimizer(split, TRAIN, total_steps=6, part_groups=[(split[2:], None)])
    assert isinstance(two, Partitioned) and [len(part.param_groups[0]["params"]) for part in two.parts] == [2, 2]
    lrs = _steps(whole, one, one_schedule, 3, seed=1)
    assert _steps(split, two, two_schedule, 3, seed=1) == lrs == [lr_at(s, TRAIN, 6) for s in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    assert [len(part.state) for part in two.parts] == [2, 2] and len(local_states(two)) == 4

    saved, saved_schedule, saved_params = copy.deepcopy(two.state_dict()), two_schedule.state_dict(), \
        [p.detach().clone() for p in split]
    _steps(whole, one, one_schedule, 3, seed=2)
    _steps(split, two, two_schedule, 3, seed=2)
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    again, again_schedule = build_optimizer(resumed, TRAIN, total_steps=6, part_groups=[(resumed[2:], None)])
    again.load_state_dict(saved)
    again_schedule.load_state_dict(saved_schedule)
    assert _steps(resumed, again, again_schedule, 3, seed=2) == [lr_at(s, TRAIN, 6) for s in range(3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed)) and all(torch.equal(a, b) for a, b in zip(whole, split))


def test_a_resume_continues_the_schedule_of_its_config_from_the_step_reached():
    """continue_schedule, as the backends load a checkpoint: with the same config the resumed steps take the
    uninterrupted run's rates bit for bit; with a longer run at a lower peak (resume_allow_changes) the first resumed
    step already takes the new schedule's rate (LambdaLR's own load gave the checkpoint's last rate, then the new
    curve times the old peak)."""
    params = _params()
    optimizer, schedule = build_optimizer(params, TRAIN, total_steps=6)
    _steps(params, optimizer, schedule, 3, seed=1)
    saved, saved_schedule = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(schedule.state_dict())
    uninterrupted = _steps(params, optimizer, schedule, 3, seed=2)
    assert uninterrupted == [lr_at(s, TRAIN, 6) for s in range(3, 6)]
    longer = dataclasses.replace(TRAIN, lr=5e-3)
    for train, total, expected in ((TRAIN, 6, uninterrupted), (longer, 8, [lr_at(s, longer, 8) for s in range(3, 6)])):
        resumed = _params()
        again, again_schedule = build_optimizer(resumed, train, total_steps=total)
        again.load_state_dict(copy.deepcopy(saved))
        continue_schedule(again_schedule, copy.deepcopy(saved_schedule))
        assert again.param_groups[0]["lr"] == again_schedule.get_last_lr()[0] == expected[0]
        assert _steps(resumed, again, again_schedule, 3, seed=2) == expected
    assert expected[0] == pytest.approx(1e-3 + 4e-3 * (1 + math.cos(math.pi / 6)) / 2)  # step 3 of 8, warmup 2
    assert uninterrupted[0] == pytest.approx(1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2)  # step 3 of 6


def test_a_set_without_trainable_parameters_adds_no_part():
    """train.lora freezes the experts: the Partitioned optimizer keeps one part, the trainable rest."""
    params = _params()
    for p in params[2:]:
        p.requires_grad_(False)
    optimizer, _ = build_optimizer(params, TRAIN, total_steps=6, part_groups=[(params[2:], None)])
    assert len(optimizers(optimizer)) == 1 and optimizer.parts[0].param_groups[0]["params"] == params[:2]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [0.5, 100.0, 0.0])
def test_clip_and_step_takes_the_step_of_clip_grad_norm(fused, max_norm):
    """A fused AdamW takes the clip coefficient as its gradient scale, the multi-tensor one has its gradients
    multiplied: both take torch's clipped step within float rounding, over 3 steps (0.5 clips, 100 does not, 0 turns
    clipping off). The clipped steps are checked against the unclipped ones, so the coefficient took effect."""
    ours, theirs, unclipped = _params(), _params(), _params()
    adamws = [torch.optim.AdamW(ps, lr=0.1, fused=fused, foreach=not fused or None)
                   for ps in (ours, theirs, unclipped)]
    assert getattr(adamws[0], "_step_supports_amp_scaling", False) == fused
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for params in (ours, theirs, unclipped):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours])
        clip_and_step(adamws[0], [p.grad for p in ours], norm, max_norm)
        assert not hasattr(adamws[0], "grad_scale")
        torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm > 0 else float("inf"))
        adamws[1].step()
        adamws[2].step()
    for a, b, c in zip(ours, theirs, unclipped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(b, c) == (max_norm != 0.5)
