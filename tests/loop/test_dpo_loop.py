"""algo=dpo end to end through launch.py (recipes=tiny_dpo_cpu, shortened), on both train backends (fsdp padded,
megatron packed): the tiny model's warm start learns from the addition task's generated pairs, nothing sampled. At
step 1 the policy is its reference (every pair tied: loss log 2, no pair preferred); the pairs' preference accuracy
then rises, and the engines, synced before each eval, serve the policy (docs/benchmarks.md has the 200-step
curves). The pairs need the warm start (from random init or a 100-step one, 12 steps leave the pairs' accuracy at
chance), which the first of these runs builds into the test session's cache."""

import math
import statistics

import pytest

from tests.loop.test_loop import launch, metrics

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.mark.parametrize("backend,packed", [("fsdp", False), ("megatron", True)], ids=["fsdp", "megatron-packed"])
def test_dpo_prefers_the_chosen_answers_and_the_engines_eval_it(tmp_path, backend, packed):
    out = launch("recipes=tiny_dpo_cpu", f"train={backend}", f"train.pack_sequences={packed}", f"num_steps={STEPS}",
                 f"rollout.eval_every_steps={STEPS}", f"output_dir={tmp_path}", "run_name=r", "tracking.progress=false",
                 "checkpoint_in_background=false", timeout=900)  # the first builds the warm start: ~1 min quiet
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path / "r")
    trained = [r for r in rows if "train/dpo_loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert trained[0]["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert trained[0]["train/dpo_accuracy"] == 0.0 and trained[0]["train/dpo_margin"] == 0.0
    late = [r["train/dpo_accuracy"] for r in trained[-5:]]
    assert statistics.fmean(late) > 0.6, late
    assert statistics.fmean(r["train/dpo_loss"] for r in trained[-5:]) < 0.67
    # 32 pairs a step: 64 responses of 2-4 tokens (1-3 digits and EOS), nothing behind the policy
    assert all(64 * 2 <= r["rollout/tokens"] <= 64 * 4 and r["rollout/weight_version_lag"] == 0.0 for r in trained)
    assert [r["step"] for r in rows if "eval/addition/accuracy" in r] == [0, STEPS]
