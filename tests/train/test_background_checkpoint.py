"""Background checkpoint writes (train/checkpoint_writer.py) on CPU with gloo: a checkpoint written by the background
thread while the rank trains on loads bitwise equal to one written in the foreground at the same step (train=fsdp
unwrapped and FSDP2 over two ranks, train=megatron DP2 with ZeRO), and the writer reports progress and failures.
Functions run on spawned ranks are module-level (pickled by name)."""

import os
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from slime_hydra.train.checkpoint_writer import HOLD_ENV, CheckpointWriter
from slime_hydra.train.config import TrainConfig
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0, micro_batch_samples=2)


def _backend(name, path):
    if name == "fsdp":
        from slime_hydra.train.fsdp import FSDPBackend

        return FSDPBackend(path, TrainConfig(**CFG), total_steps=6, keep_reference=True)
    from slime_hydra.train.megatron.backend import MegatronBackend

    return MegatronBackend(path, TrainConfig(**CFG), total_steps=6, keep_reference=True)


def _restored(backend) -> dict:
    """What loading a checkpoint restores, as host copies in parameter order: parameters, Adam state (this rank's
    shard or ZeRO partition), scheduler, step, every RNG, the reference shards."""
    optimizer = getattr(backend.optimizer, "optim", backend.optimizer)  # ZeroRedundancyOptimizer: its partition's
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
    return {"params": [local(p) for p in params],
            "adam": [{k: local(v) for k, v in optimizer.state[p].items()} for p in params if p in optimizer.state],
            "scheduler": backend.scheduler.state_dict(), "step": backend.step, "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(), "numpy_rng": np.random.get_state()[1].copy(),
            "ref": {k: v.clone() for k, v in backend._ref_shards.items()}}


def _foreground_and_held_background(rank, world, name, path, tmp):
    backend = _backend(name, path)
    share = toy_batch().select(list(range(backend.dp_rank, 8, backend.dp_size)))
    for _ in range(2):
        backend.train_step(share, pg_loss)
    backend.save(tmp / "foreground")
    held = tmp / "background"
    held.mkdir(exist_ok=True)
    os.environ[HOLD_ENV] = str(held)
    backend.save(held, background=True)
    while not (held / f"held_{os.getpid()}").exists():
        time.sleep(0.05)
    writing = backend.save_finished()  # held: still writing
    torch.rand(3)  # the live RNG and weights move on while the write waits
    backend.train_step(share, pg_loss)
    moved = _restored(backend)
    dist.barrier()  # every rank trained before any write goes on
    if rank == 0:
        (held / "release").touch()
    seconds = backend.save_finished(wait=True)
    del os.environ[HOLD_ENV]
    out = {"writing": writing, "seconds": seconds, "moved": moved}
    for source in ("foreground", "background"):
        loaded = _backend(name, path)
        loaded.load(tmp / source)
        out[source] = _restored(loaded)
        out[source + "_next_loss"] = float(loaded.train_step(share, pg_loss)["pg_loss"])
    return out


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("name, world", [("fsdp", 1), ("fsdp", 2), ("megatron", 2)])  # fsdp 1: unwrapped model
def test_a_background_checkpoint_written_while_training_on_loads_bitwise_equal_to_a_foreground_one(
        tmp_path, name, world):
    path = tiny_checkpoint("qwen3")
    for rank, out in enumerate(run_ranks(world, _foreground_and_held_background, name, path, tmp_path)):
        assert out["writing"] is None and out["seconds"] > 0, rank
        assert _equal(out["background"], out["foreground"]), rank
        assert out["background"]["step"] == 2 and out["moved"]["step"] == 3
        assert not _equal(out["moved"]["params"], out["foreground"]["params"])  # the live state did move on
        assert not torch.equal(out["moved"]["torch_rng"], out["foreground"]["torch_rng"])
        assert out["background_next_loss"] == out["foreground_next_loss"]


def test_the_writer_runs_parts_in_order_reports_seconds_and_raises_a_failed_write(tmp_path, monkeypatch):
    writer = CheckpointWriter()
    assert writer.finished() == 0.0  # nothing started
    staged = writer.stage({"w": torch.arange(4.0), "step": 3})
    monkeypatch.setenv(HOLD_ENV, str(tmp_path))
    done = []
    writer.start(tmp_path / "step_000001", lambda: done.append("a"), lambda: done.append("b"))
    while not list(tmp_path.glob("held_*")):
        time.sleep(0.01)
    assert writer.finished() is None and done == []
    with pytest.raises(RuntimeError, match="still running"):
        writer.start(tmp_path / "step_000002", lambda: None)
    (tmp_path / "release").touch()
    assert writer.finished(wait=True) > 0 and done == ["a", "b"]
    assert torch.equal(staged["w"], torch.arange(4.0)) and staged["step"] == 3
    monkeypatch.delenv(HOLD_ENV)

    def disk_full():
        raise OSError(28, "No space left on device")

    writer.start(tmp_path / "step_000003", disk_full, lambda: done.append("never"))
    with pytest.raises(RuntimeError, match="step_000003 failed") as failed:
        writer.finished(wait=True)
    assert isinstance(failed.value.__cause__, OSError) and done == ["a", "b"]


def test_the_stager_copies_what_training_then_changes_in_place():
    writer = CheckpointWriter()
    live = {"model": {"w": torch.ones(3)}, "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}}}
    staged = writer.stage(live)
    live["model"]["w"].add_(1)
    live["optim"]["state"][0]["exp_avg"].add_(5)
    assert torch.equal(staged["model"]["w"], torch.ones(3))
    assert torch.equal(staged["optim"]["state"][0]["exp_avg"], torch.zeros(3))
    writer.close()  # what DCP's async_save may call after a save: the buffers stay (torch 2.11 emptied its stager's)
    again = writer.stage(live)  # the stager reuses its buffers (so a save waits for the previous write)
    assert torch.equal(again["model"]["w"], torch.full((3,), 2.0))
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()
    assert writer.stage(live)["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()  # a third time too
    live["model"]["w"] = torch.ones(4, dtype=torch.float64)  # a new layout: new buffers
    grown = writer.stage(live)
    assert grown["model"]["w"].dtype == torch.float64 and torch.equal(grown["model"]["w"], torch.ones(4, dtype=torch.float64))


def test_the_stager_copies_numpy_rng_state_and_non_tensor_values():
    import numpy as np
    writer = CheckpointWriter()
    live = {"rng": {"numpy": np.random.get_state()}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    staged = writer.stage(live)
    live["groups"][0]["lr"] = 0.2
    np.random.rand(8)
    assert staged["groups"][0]["lr"] == 0.1 and staged["groups"][0]["betas"] == (0.9, 0.99)
    assert not np.array_equal(staged["rng"]["numpy"][1], np.random.get_state()[1])
