"""The run's warnings: nearly every response truncated, or the same reward step after step, named once each."""

from slime_hydra.tracking.alerts import CONSTANT_STEPS, TRUNCATED_STEPS, RunAlerts


def feed(alerts: RunAlerts, rows: list[dict]) -> list[tuple[int, str]]:
    return [(step, line) for step, row in enumerate(rows, 1) for line in alerts.observe(step, row)]


def test_truncation_warns_once_after_its_steps_in_a_row_and_again_after_it_clears():
    cut, ok = {"rollout/truncated_ratio": 1.0}, {"rollout/truncated_ratio": 0.2}
    rows = [cut, cut, ok] + [cut] * (TRUNCATED_STEPS + 2) + [ok] + [cut] * TRUNCATED_STEPS
    warned = feed(RunAlerts(), rows)
    assert [step for step, _ in warned] == [3 + TRUNCATED_STEPS, len(rows)]
    assert "100% of the responses were cut at rollout.max_response_tokens" in warned[0][1]


def test_a_constant_reward_warns_and_names_the_truncation_behind_it():
    rows = [{"rollout/raw_reward": 0.0, "rollout/truncated_ratio": 1.0}] * CONSTANT_STEPS
    warned = feed(RunAlerts(), rows)
    assert [step for step, _ in warned] == [TRUNCATED_STEPS, CONSTANT_STEPS]
    assert "rollout/raw_reward has been 0.000 for 5 steps" in warned[1][1]
    assert "see rollout.max_response_tokens" in warned[1][1] and "reward.target" in warned[1][1]


def test_a_reward_that_moves_never_warns():
    rewards = [0.1, 0.1, 0.1, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1, 0.3]  # four alike, never five in a row
    assert feed(RunAlerts(), [{"rollout/raw_reward": r, "rollout/truncated_ratio": 0.5} for r in rewards]) == []


def test_the_tracker_prints_them_as_it_logs(tmp_path, capsys):
    from slime_hydra.tracking.config import TrackingConfig
    from slime_hydra.tracking.tracker import Tracker

    tracker = Tracker(TrackingConfig(), tmp_path, "r", {})
    for step in range(1, TRUNCATED_STEPS + 1):
        tracker.log(step, {"rollout/truncated_ratio": 1.0, "rollout/raw_reward": 0.0})
    tracker.close()
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and f"warning (step {TRUNCATED_STEPS})" in out
