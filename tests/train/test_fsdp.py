"""train=fsdp on CPU with gloo: exact DP / micro-batch invariance, logprob alignment, reference policy, checkpoint
resume, HF export. Functions run on spawned ranks must be module-level (pickled by name)."""

import os
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_hydra.train.backend import load_rank_file, rng_state, set_rng_state
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from tests.train.harness import assert_policy_logprobs, pg_loss, run_ranks, tiny_checkpoint, toy_batch

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0)


def _three_steps(rank, world, path, micro, max_tokens):
    train = TrainConfig(**CFG, micro_batch_samples=micro, max_tokens_per_gpu=max_tokens)
    backend = FSDPBackend(path, train, total_steps=3)
    mine = toy_batch().select(list(range(rank, 8, world)))
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(mine, pg_loss) for _ in range(3))]


def test_dp2_and_micro_batch_splits_equal_single_rank_full_batch():
    path = tiny_checkpoint()
    reference = run_ranks(1, _three_steps, path, 8, None)[0]
    for world, micro, max_tokens in ((2, 1, None), (1, 3, None), (1, 8, 20)):
        got = run_ranks(world, _three_steps, path, micro, max_tokens)[0]
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5 * max(1, ref_norm), (world, micro)
    assert reference[2][0] < reference[0][0]  # the policy-gradient loss falls over 3 steps


def _steps_and_logprobs(rank, world, path, compiled):
    train = TrainConfig(**CFG, micro_batch_samples=3, compile=compiled)  # micro-batches of 3, 3, 2: shapes change
    backend = FSDPBackend(path, train, total_steps=2)
    batch = toy_batch()
    steps = [backend.train_step(batch.select(list(range(rank, 8, world))), pg_loss) for _ in range(2)]
    logp, entropy = backend.logprobs(batch, with_entropy=True)
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in steps], logp, entropy


def test_compiled_layers_give_the_eager_loss_grad_norm_and_logprobs():
    path = tiny_checkpoint()
    eager = run_ranks(1, _steps_and_logprobs, path, False)[0]
    steps, logp, entropy = run_ranks(1, _steps_and_logprobs, path, True)[0]  # ~20 s of CPU compiles
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, eager[0]):
        assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5 * max(1, ref_norm)
    torch.testing.assert_close(logp, eager[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, eager[2], atol=1e-5, rtol=0)


def _bf16_steps(rank, world, path, fsdp):
    import slime_hydra.train.fsdp as module

    module.compute_dtype = lambda train, device: torch.bfloat16  # CPU runs in fp32; take the GPU's bf16 path here
    backend = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=3), total_steps=3, fsdp=fsdp)
    batch = toy_batch()
    steps = [backend.train_step(batch, pg_loss) for _ in range(3)]
    weights = {n: t.clone() for n, t in backend.iter_full_weights()}
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in steps], weights, backend.logprobs(batch)[0]


def test_one_rank_bf16_compute_copy_equals_fsdp_mixed_precision():
    path = tiny_checkpoint()
    plain_steps, plain_weights, plain_logp = run_ranks(1, _bf16_steps, path, False)[0]  # the default on one rank
    fsdp_steps, fsdp_weights, fsdp_logp = run_ranks(1, _bf16_steps, path, True)[0]
    for (loss, norm), (ref_loss, ref_norm) in zip(plain_steps, fsdp_steps):
        assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5 * max(1, ref_norm)
    for name, tensor in fsdp_weights.items():
        assert plain_weights[name].dtype == tensor.dtype == torch.float32  # fp32 masters either way
        torch.testing.assert_close(plain_weights[name], tensor, atol=1e-6, rtol=0)
    torch.testing.assert_close(plain_logp, fsdp_logp, atol=1e-5, rtol=0)
    assert plain_steps[2][0] < plain_steps[0][0]


def _logprob_checks(rank, world, path):
    train = TrainConfig(**CFG, micro_batch_samples=3)
    backend = FSDPBackend(path, train, total_steps=2, keep_reference=True)
    batch = toy_batch()
    current, entropy = backend.logprobs(batch, "current", with_entropy=True)
    ref0, _ = backend.logprobs(batch, "ref")
    backend.train_step(batch, pg_loss)
    after, _ = backend.logprobs(batch, "current")
    ref1, _ = backend.logprobs(batch, "ref")
    return current, entropy, ref0, after, ref1


def test_logprobs_align_with_a_plain_forward_and_reference_is_the_initial_policy():
    path = tiny_checkpoint()
    assert_policy_logprobs(path, *run_ranks(1, _logprob_checks, path)[0])


def _run_with_checkpoint(rank, world, path, ckpt, phase):
    train = TrainConfig(**CFG, micro_batch_samples=2)
    backend = FSDPBackend(path, train, total_steps=6, keep_reference=True)
    batch = toy_batch().select(list(range(rank, 8, world)))
    losses = []
    if phase in ("full", "first"):
        for _ in range(2):
            losses.append(float(backend.train_step(batch, pg_loss)["pg_loss"]))
        if phase == "first":
            backend.save(ckpt)
            return losses
    else:
        backend.load(ckpt)
    for _ in range(2):
        losses.append(float(backend.train_step(batch, pg_loss)["pg_loss"]))
    return losses + [backend.step]


@pytest.mark.parametrize("world", [1, 2])  # one rank: the unwrapped model; two: FSDP
def test_checkpoint_resume_reproduces_the_next_steps_exactly(tmp_path, world):
    path = tiny_checkpoint()
    full = run_ranks(world, _run_with_checkpoint, path, tmp_path / "ckpt", "full")[0]
    first = run_ranks(world, _run_with_checkpoint, path, tmp_path / "ckpt", "first")[0]
    resumed = run_ranks(world, _run_with_checkpoint, path, tmp_path / "ckpt", "resume")[0]  # a fresh process group
    assert first == full[:2]
    assert resumed == full[2:]  # bitwise equal losses after resume, and the step counter continued (4)


class RunsCode:
    """Unpickling this creates a directory: what any code in a tampered checkpoint could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_rank_files_load_weights_only(tmp_path):
    """A rank file (RNG states, NumPy's included, and tensors) round-trips through load_rank_file; one holding any
    other object is refused without running it."""
    state = {"rng": rng_state(), "ref": {"w": torch.arange(6.0).reshape(2, 3)}}
    torch.save(state, tmp_path / "rank0.pt")
    loaded = load_rank_file(tmp_path / "rank0.pt")
    assert torch.equal(loaded["ref"]["w"], state["ref"]["w"]) and loaded["rng"]["python"] == state["rng"]["python"]
    assert (loaded["rng"]["numpy"][0], loaded["rng"]["numpy"][2:]) == (state["rng"]["numpy"][0],
                                                                     state["rng"]["numpy"][2:])
    assert (loaded["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all()
    set_rng_state(loaded["rng"])
    torch.save({"rng": rng_state(), "ref": RunsCode(tmp_path / "ran")}, tmp_path / "rank1.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_rank_file(tmp_path / "rank1.pt")
    assert not (tmp_path / "ran").exists()


def _export(rank, world, path, out):
    backend = FSDPBackend(path, TrainConfig(**CFG, micro_batch_samples=4), total_steps=1)
    batch = toy_batch()
    backend.train_step(batch.select(list(range(rank, 8, world))), pg_loss)
    weights = {n: t.clone() for n, t in backend.iter_full_weights()}
    backend.export_hf(out)
    return weights, backend.logprobs(batch)[0]


@pytest.mark.parametrize("world", [1, 2])
def test_export_hf_and_full_weights_match_the_trained_model(tmp_path, world):
    path = tiny_checkpoint()
    weights, logp = run_ranks(world, _export, path, tmp_path / "hf")[0]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = exported.state_dict()
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any(not torch.equal(original[n], weights[n]) for n in weights)  # trained, not the initial weights


def value_loss(values, _entropy, mb):
    """0.5 (V - G)^2, token mean under the mask (returns G in extras)."""
    m = mb.loss_mask
    loss = 0.5 * (((values - mb.extras["returns"]) ** 2) * m).sum() / m.sum()
    return loss, {"value_loss": loss.detach()}


def _critic(rank, world, path):
    from tests.train.harness import toy_batch as make

    batch = make()
    batch.extras["returns"] = batch.extras["advantages"] * 2  # targets +-1 per token
    critic = FSDPBackend(path, TrainConfig(**{**CFG, "lr": 1.0}, critic_lr=3e-3, micro_batch_samples=4),
                         total_steps=40, role="critic")
    mine = batch.select(list(range(rank, 8, world)))
    losses = [float(critic.train_step(mine, value_loss)["value_loss"]) for _ in range(40)]
    return losses, critic.values(batch), batch.extras["returns"] * batch.loss_mask, critic.scheduler.get_last_lr()


def test_critic_learns_value_targets_with_its_own_learning_rate():
    losses, values, targets, lr = run_ranks(2, _critic, tiny_checkpoint())[0]
    assert lr == [3e-3]  # critic_lr, not lr
    assert losses[-1] < 0.1 * losses[0]
    assert ((values - targets).abs() * (targets != 0)).max() < 0.5  # every trained token's value near its target
