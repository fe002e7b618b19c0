"""Colocated offload on a GPU (python3 -m pytest -m gpu tests/train/test_offload_gpu.py), both backends: between
two steps, ``start_offload()`` + ``offload()`` leave (almost) nothing of the trainer on the GPU, parameters and
optimizer state on the host, and after ``onload()`` (the optimizer state's copies still in flight, held back on
purpose, into memory that held NaNs) the next step and the logprobs are those of a twin that never moved."""

import gc

import pytest
import torch

from slime_hydra.train.config import TrainConfig
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _offload_between_steps(rank, world, path, name):
    """For a twin that stays and one that offloads after its first step: both steps' (loss, grad norm), the
    logprobs after them, and for the mover the GPU bytes it holds (above what the process held before building
    it) before offload / after offload / after onload, where its tensors were while offloaded, and whether the
    optimizer state was still on its way back when ``onload`` returned."""
    if name == "megatron":
        from slime_hydra.train.megatron.backend import MegatronBackend as Backend
    else:
        from slime_hydra.train.fsdp import FSDPBackend as Backend
    batch = toy_batch()
    train = TrainConfig(lr=1e-2, dtype="bf16", clip_grad=1.0, micro_batch_samples=4)
    out = {}
    for moves in (False, True):
        baseline = torch.cuda.memory_allocated()  # after the twin: cuBLAS workspaces (64 MiB on an H100) and such
        backend = Backend(path, train, total_steps=2)
        steps = [backend.train_step(batch, pg_loss)]
        if moves:
            before = torch.cuda.memory_allocated()
            backend.start_offload()  # as the loop does after training: the optimizer state's copies start
            held = backend.offload()
            state = [v for s in getattr(backend.optimizer, "optim", backend.optimizer).state.values()
                     for v in s.values() if torch.is_tensor(v)]
            devices = {t.device.type for t in [*backend.model.parameters(), *state]}
            poison = torch.full((int(before) // 4,), float("nan"), device="cuda")
            del poison  # its blocks stay in torch's cache: the state comes back into NaN-filled memory
            with torch.cuda.stream(backend._side_stream()):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock ahead of the copies back
            back = backend.onload()
            in_flight = not backend._arriving[0].query()
            out["memory"] = (before - baseline, held - baseline, back - baseline, devices, len(state), in_flight)
        steps.append(backend.train_step(batch, pg_loss))
        out[moves] = ([(float(m["pg_loss"]), m["grad_norm"]) for m in steps], backend.logprobs(batch)[0])
        del backend
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_offload_frees_the_gpu_and_the_next_step_is_unchanged(name):
    out = run_ranks(1, _offload_between_steps, tiny_checkpoint(), name)[0]
    before, held, back, devices, states, in_flight = out["memory"]
    print(f"{name}: the trainer held {before} B on the GPU, {held} B offloaded, {back} B onloaded")
    assert devices == {"cpu"} and states > 0, devices  # parameters and Adam state were on the host
    assert in_flight  # onload returned before the optimizer state arrived; the step below waited for it
    assert before > 0 and held <= 0.05 * before, (held, before)  # the GPU kept (almost) nothing of it
    # back: fp32 parameters and Adam's two moments (12 B a parameter), not yet the bf16 compute copies (2 B), which
    # offload dropped and the next forward rebuilds: 12/14 of before (measured 0.857 on an H100)
    assert back >= 0.8 * before, (back, before)
    stayed, moved = out[False], out[True]
    for (loss, norm), (want_loss, want_norm) in zip(moved[0], stayed[0]):
        assert abs(loss - want_loss) <= 1e-3 * abs(want_loss) and abs(norm - want_norm) <= 1e-3 * want_norm
    torch.testing.assert_close(moved[1], stayed[1], atol=1e-3, rtol=0)
    assert moved[0][1][0] < moved[0][0][0]  # the second step trains from where the first left off
