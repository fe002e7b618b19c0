"""On-policy distillation's teacher in the trainer ranks (role="teacher", train/group.TrainRank): on both backends it
holds a second checkpoint frozen (no optimizer, no gradient) beside the student, and its logprobs of the student's
tokens equal a plain transformers forward of that checkpoint (fp32, 1e-5), before and after the student trains;
train=megatron splits it over TP as it splits the student."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.train.megatron.backend import MegatronBackend
from tests.train.harness import TINY, hf_response_logprobs, pg_loss, run_ranks, toy_batch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(student, teacher): two random inits of one vocabulary; the teacher wider and deeper, as teachers are."""
    root = tmp_path_factory.mktemp("opd")
    student = build_random_checkpoint(TINY, root / "student", seed=0)
    big = ModelConfig(**{**TINY.__dict__, "num_layers": 3, "hidden_size": 96, "ffn_hidden_size": 192})
    return student, build_random_checkpoint(big, root / "teacher", seed=1)


def _teacher_beside_student(rank, world, student, teacher, kind, tp):
    Backend = MegatronBackend if kind == "megatron" else FSDPBackend
    train = TrainConfig(dtype="fp32", lr=1e-2, micro_batch_samples=4, tp=tp, num_gpus=world)
    actor = Backend(student, train, total_steps=2, device="cpu")
    held = Backend(teacher, train, 0, device="cpu", role="teacher")
    batch = toy_batch()
    before = held.logprobs(batch, "current")[0]
    student_before = actor.logprobs(batch, "current")[0]
    actor.train_step(batch, pg_loss)
    return dict(before=before, after=held.logprobs(batch, "current")[0], student_before=student_before,
                student_after=actor.logprobs(batch, "current")[0], optimizer=held.optimizer,
                trainable=sum(p.requires_grad for p in held.model.parameters()))


@pytest.mark.parametrize("kind,world,tp", [("fsdp", 1, 1), ("megatron", 1, 1), ("megatron", 2, 2)],
                         ids=["fsdp", "megatron", "megatron-tp2"])
def test_the_teacher_scores_the_students_tokens_as_transformers_does_and_stays_frozen(checkpoints, kind, world, tp):
    student, teacher = checkpoints
    out = run_ranks(world, _teacher_beside_student, str(student), str(teacher), kind, tp)[0]
    want = hf_response_logprobs(AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32), toy_batch())
    torch.testing.assert_close(out["before"], want, atol=1e-5, rtol=0)
    assert torch.equal(out["after"], out["before"])  # the student's step left the teacher as it was
    assert (out["student_after"] - out["student_before"]).abs().max() > 1e-3  # ... and moved the student
    assert (out["student_before"] - out["before"]).abs().max() > 0.1  # two different models
    assert out["optimizer"] is None and out["trainable"] == 0
