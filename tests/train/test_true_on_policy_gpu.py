"""algo.true_on_policy on a GPU (python3 -m pytest -m gpu tests/train/test_true_on_policy_gpu.py): the batch-invariant
engine in bf16 with its CUDA graphs, nine requests through four slots, and the batch-invariant trainers (fsdp, and
megatron at TP1) in bf16 on padded and packed micro-batches, and every other dense family packed: the same logprobs,
bit for bit (the CPU's test, tests/train/test_true_on_policy.py, on the GPU's kernels; scripts/probe_mismatch.py
--engines invariant --variants invariant --ragged does it at Qwen2.5-0.5B's shape)."""

import pytest
import torch

from tests.train.harness import run_ranks, tiny_checkpoint
from tests.train.test_true_on_policy import DENSE, _trainer_logprobs, differences, generate, model_dir  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_trainer_logprobs_equal_the_engines_bit_for_bit_in_bf16(model_dir, packed, kind):  # noqa: F811
    samples = generate(model_dir, batch_invariant=True, device="cuda")
    logp = run_ranks(1, _trainer_logprobs, model_dir, samples, True, packed, "cuda", kind)[0]
    assert max(differences(samples, logp)) == 0.0


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
@pytest.mark.parametrize("family", [f for f in DENSE if f != "qwen2"])
def test_every_dense_family_is_exact_in_bf16(family, kind):
    path = tiny_checkpoint(family)
    samples = generate(path, batch_invariant=True, device="cuda")
    assert max(differences(samples, run_ranks(1, _trainer_logprobs, path, samples, True, True, "cuda", kind)[0])) == 0.0
