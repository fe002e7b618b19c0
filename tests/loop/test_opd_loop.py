"""algo=opd end to end through launch.py, sync on both train backends and async: the trainer ranks hold the teacher
(here the student's own starting checkpoint), score every sampled token with it, and mix the reverse KL into the
GRPO advantage (reward_weight 1). At step 1 the student is its teacher: the reverse KL is 0 up to the engine-vs-
trainer mismatch; once the student trained on its random rewards it differs, and the teacher's time is logged.
Learning from a stronger teacher: docs/benchmarks.md, "On-policy distillation on the CPU"."""

import pytest

from tests.loop.test_loop import SHAPE, SMALL, launch, train_rows

pytestmark = pytest.mark.slow

STEPS = 4


def _student_checkpoint() -> str:
    """The random tiny model SHAPE starts from (built once in the test session's cache)."""
    from slime_hydra.config import compose, to_config
    from slime_hydra.model.warm_start import resolve_model_path

    cfg = to_config(compose(SHAPE))
    return str(resolve_model_path(cfg.model, cfg.data, cfg.seed))


@pytest.mark.parametrize("backend,mode", [("fsdp", "sync"), ("megatron", "sync"), ("fsdp", "async")],
                         ids=["fsdp", "megatron", "fsdp-async"])
def test_the_teacher_in_the_trainer_ranks_scores_every_sampled_token(tmp_path, backend, mode):
    out = launch("algo=opd", f"algo.teacher.path={_student_checkpoint()}", "algo.teacher.reward_weight=1",
                 f"train={backend}", f"mode={mode}", f"num_steps={STEPS}", f"output_dir={tmp_path}", "run_name=r",
                 "checkpoint_in_background=false", "train.lr=1e-3", *SMALL)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "each holding the teacher" in out.stdout  # the plan says where the teacher is
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kl = [r["train/opd_reverse_kl"] for r in rows]
    assert abs(kl[0]) < 1e-5, kl  # the student is its teacher (fp32 on CPU: mismatch ~1e-7)
    assert abs(kl[-1]) > 1e-3, kl  # three steps later it is not
    assert all(r["train/teacher_logprob"] < -1.0 for r in rows)  # a random model: ~log(1/100) a token
    assert all(r["perf/teacher_time"] > 0 for r in rows)
