"""algo=dpo end to end through launch.py (recipes=tiny_dpo_cpu, shortened, from the tiny model's random init), on
both train backends (fsdp padded, megatron packed): each step trains the addition task's next 32 generated pairs,
nothing sampled. At step 1 the policy is its reference (every pair tied: loss log 2, no pair preferred, margin 0);
after it, the policy has moved off the reference (nonzero margins), and the engines, synced before each eval, serve
it. Learning is shown elsewhere: tests/train/test_dpo_objective.py (DPO's loss halves on fixed pairs, both
backends) and docs/benchmarks.md (the recipe from its warm start: preference accuracy 0.67 -> 0.92); the warm start
is not built here, since beside the SLURM group its build alone took 7.8 minutes in CI."""

import math

import pytest

from tests.loop.test_loop import launch, metrics

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.mark.parametrize("backend,packed", [("fsdp", False), ("megatron", True)], ids=["fsdp", "megatron-packed"])
def test_dpo_trains_the_datas_pairs_and_the_engines_eval_it(tmp_path, backend, packed):
    out = launch("recipes=tiny_dpo_cpu", "model.sft_warm_start_steps=0", f"train={backend}",
                 f"train.pack_sequences={packed}", f"num_steps={STEPS}", f"rollout.eval_every_steps={STEPS}",
                 f"output_dir={tmp_path}", "run_name=r", "tracking.progress=false", "checkpoint_in_background=false")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path / "r")
    trained = [r for r in rows if "train/dpo_loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert trained[0]["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert trained[0]["train/dpo_accuracy"] == 0.0 and trained[0]["train/dpo_margin"] == 0.0
    assert all(abs(r["train/dpo_margin"]) > 1e-4 for r in trained[1:])  # ... and then is not
    assert all(0.0 <= r["train/dpo_accuracy"] <= 1.0 for r in trained)
    # 32 pairs a step: 64 responses of 2-4 tokens (1-3 digits and EOS), nothing behind the policy
    assert all(64 * 2 <= r["rollout/tokens"] <= 64 * 4 and r["rollout/weight_version_lag"] == 0.0 for r in trained)
    assert [r["step"] for r in rows if "eval/addition/accuracy" in r] == [0, STEPS]
