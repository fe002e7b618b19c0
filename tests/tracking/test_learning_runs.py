"""scripts/learning_runs.py summarizes a run from its metrics.jsonl: held-out accuracy is the eval set's own figure,
never one of its per-level figures (an eval set over several levels logs both)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "learning_runs.py"


@pytest.fixture(scope="module")
def learning_runs():
    spec = importlib.util.spec_from_file_location("learning_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_reads_the_set_accuracy_not_a_level(learning_runs, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": 0, "time": 0.0, "eval/arithmetic/accuracy": 0.5, "eval/arithmetic/level_1/accuracy": 1.0,
             "eval/arithmetic/level_2/accuracy": 0.25},
            {"step": 0, "time": 1.0, "rollout/raw_reward": 0.4, "perf/step_time": 1.0},
            {"step": 1, "time": 2.0, "rollout/raw_reward": 0.6, "perf/step_time": 3.0,
             "eval/arithmetic/accuracy": 0.75, "eval/arithmetic/level_1/accuracy": 0.9,
             "eval/arithmetic/level_2/accuracy": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = learning_runs.summarize(run)
    assert (got["eval_first"], got["eval_peak"], got["eval_last"], got["eval_last_step"]) == (0.5, 0.75, 0.75, 1)
    assert (got["steps"], got["reward_first"], got["reward_last"], got["step_s_median"]) == (2, 0.4, 0.6, 2.0)
