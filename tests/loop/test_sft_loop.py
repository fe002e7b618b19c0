"""algo=sft end to end through launch.py (recipes=tiny_sft_cpu, shortened), on both train backends (fsdp padded,
megatron packed): the tiny model from its random init trains on the addition problems' answers, nothing sampled.
The loss falls, every step trains on the data's next 64 rows (their response tokens and EOS), the policy's version
is the step's (lag 0), the held-out loss falls by half, and the engines, synced before each eval, serve it (the
accuracy after 30 steps is still 0: docs/benchmarks.md has the 350-step curves)."""

import pytest

from tests.loop.test_loop import launch, metrics

pytestmark = pytest.mark.slow

STEPS = 30


@pytest.mark.parametrize("backend,packed", [("fsdp", False), ("megatron", True)], ids=["fsdp", "megatron-packed"])
def test_sft_trains_on_the_datas_responses_and_the_engines_eval_it(tmp_path, backend, packed):
    out = launch("recipes=tiny_sft_cpu", f"train={backend}", f"train.pack_sequences={packed}", f"num_steps={STEPS}",
                 f"rollout.eval_every_steps={STEPS}", f"output_dir={tmp_path}", "run_name=r", "tracking.progress=false",
                 "checkpoint_in_background=false")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path / "r")
    trained = [r for r in rows if "train/sft_loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    losses = [r["train/sft_loss"] for r in trained]
    assert losses[-1] < 0.5 * losses[0], losses
    # 64 answers of 1-3 digits and EOS a step; no advantages, no rewards, nothing behind the policy
    assert all(64 * 2 <= r["rollout/tokens"] <= 64 * 4 and r["rollout/weight_version_lag"] == 0.0 for r in trained)
    assert not any(key.startswith(("train/advantage", "rollout/raw_reward")) for r in trained for key in r)
    held_out = {r["step"]: r["eval/addition/sft_loss"] for r in rows if "eval/addition/sft_loss" in r}
    assert sorted(held_out) == [0, STEPS] and held_out[STEPS] < 0.5 * held_out[0], held_out
    assert [r["step"] for r in rows if "eval/addition/accuracy" in r] == [0, STEPS]  # the engines' greedy eval ran
