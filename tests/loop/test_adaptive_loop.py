"""Adaptive difficulty end to end through launch.py: the env/ metrics reach metrics.jsonl, the levels follow the
rewards, and a resumed run draws exactly the prompts the sampler's rule gives from the checkpointed state.

The random tiny model answers (nearly) nothing right, so the level walks down from start_level; the test replays the
sampler in-process with the rewards the run logged, so it holds whatever the model answers.
"""

import json
from pathlib import Path

import pytest

from slime_hydra.data.adaptive import AdaptiveSampler, GroupResult
from slime_hydra.data.config import AdaptiveConfig
from tests.loop.test_loop import SHAPE, launch, metrics, train_rows

ADAPTIVE = ("data=arithmetic", "reward=task", "data.adaptive.enabled=true", "data.adaptive.start_level=3",
            "data.adaptive.window_groups=4", "rollout.eval_every_steps=0", "debug.save_rollouts=true",
            "checkpoint_in_background=false")
SEED = 1234  # data.seed's default

pytestmark = pytest.mark.slow


def groups(run: Path, step: int) -> list[list[dict]]:
    """The step's samples by group, in group order."""
    by_group: dict[int, list[dict]] = {}
    for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines():
        sample = json.loads(line)
        by_group.setdefault(sample["group_index"], []).append(sample)
    return [by_group[g] for g in sorted(by_group)]


def test_levels_follow_the_rewards_and_a_resume_draws_the_same_prompts(tmp_path):
    run = tmp_path / "r"
    first = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=2", *ADAPTIVE, *SHAPE)
    assert first.returncode == 0, first.stderr[-4000:]
    state = json.loads((run / "checkpoints" / "step_000002" / "rollout.json").read_text())["source"]
    assert state["kind"] == "adaptive" and state["drawn"] == 8 and state["tasks"] == ["arithmetic"]
    resumed = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=4", "resume_allow_changes=true",  # longer
                     *ADAPTIVE, *SHAPE)  # (the decaying learning rate's horizon moves: a resume refuses it unasked)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout

    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    replay = AdaptiveSampler(AdaptiveConfig(enabled=True, start_level=3, window_groups=4), "arithmetic", SEED,
                             make_records=lambda r: r)
    for step, logged in enumerate(rows, start=1):
        expected = [r["prompt"] for r in replay.take(4)]
        got = groups(run, step)
        assert [g[0]["prompt"] for g in got] == expected, f"step {step}"
        results = [GroupResult("arithmetic", g[0]["metadata"]["level"], sum(s["reward"] for s in g) / len(g))
                   for g in got]
        wanted = replay.update(results)
        assert {k: v for k, v in logged.items() if k.startswith("env/")} == pytest.approx(wanted)
    levels = [r["env/arithmetic/level"] for r in rows]
    if all(r["env/arithmetic/pass_rate"] == 0 for r in rows):  # what the random model does
        assert levels == [2, 1, 1, 1]
    assert all(0 <= r["env/arithmetic/pass_rate"] <= 1 and r["env/arithmetic/groups"] == 4 for r in rows)
    assert any(k.startswith("env/arithmetic/level_") for k in rows[0])
    assert not [m for m in metrics(run) if "eval/arithmetic/accuracy" in m]


def test_report_plots_level_and_pass_rate(tmp_path):
    from slime_hydra.report import write_report

    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": s, "time": s, "rollout/raw_reward": 0.5, "env/countdown/level": float(1 + s // 3),
              "env/countdown/pass_rate": 0.8, "env/countdown/window_pass_rate": 0.75,
              "env/countdown/level_1/pass_rate": 0.8} for s in range(8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    written = write_report(run)
    assert run / "plots" / "env_countdown.png" in written and (run / "plots" / "env_countdown.png").stat().st_size > 0
