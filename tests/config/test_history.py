"""History is never lost (issue 45, item 4): resume=never beside an earlier run, each launch's provenance kept, a
resume that changes what the run learns refused (or, allowed, its learning-rate jump shown), metrics.jsonl rewritten
atomically. The real run's schedule across a kill and a resume: tests/loop/test_loop.py."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from slime_hydra.config import PROJECT_ROOT, compose, load_run_config, to_config
from slime_hydra.launch.resume import FREE_ON_RESUME, check_resume, config_changes, schema_keys
from slime_hydra.launch.run_dir import holds_run, launch_folders, unused_sibling, write_provenance
from slime_hydra.tracking import tracker
from slime_hydra.tracking.config import TrackingConfig


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=120)


def run_with_checkpoint(root: Path, *overrides: str, step: int = 6) -> Path:
    """<root>/r as a run leaves it at checkpoint ``step``: its resolved.yaml (num_steps=6 and ``overrides``),
    metrics.jsonl, checkpoints/latest -> step_<step> with its loop.json."""
    run = root / "r"
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "loop.json").write_text(json.dumps({"step": step, "rollouts_ahead": []}))
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    resolved = compose([f"output_dir={root}", "run_name=r", "num_steps=6", *overrides])
    (run / "resolved.yaml").write_text(OmegaConf.to_yaml(resolved, resolve=True))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/lr": 1e-4}) + "\n"
                                               for s in range(1, step + 1)))
    return run


def resume_check(root: Path, *overrides: str, sweep_point: bool = False) -> tuple[Path, list, str]:
    """check_resume as launch() calls it for ``overrides`` (with output_dir=root run_name=r): (run dir, problems,
    what it printed)."""
    resolved = compose([f"output_dir={root}", "run_name=r", *overrides])
    out = io.StringIO()
    run_dir, problems = check_resume(to_config(resolved), resolved, root / "r", Console(file=out, width=400),
                                     sweep_point)
    return run_dir, problems, out.getvalue()


# ---- resume=never ------------------------------------------------------------------------------------------------
def test_resume_never_in_a_run_directory_runs_beside_it_and_leaves_it_alone(tmp_path):
    run = run_with_checkpoint(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    out = launch(f"output_dir={tmp_path}", "run_name=r", "resume=never", "dry_run=true")
    assert out.returncode == 0, out.stderr
    assert f"resume=never: {run} holds a run and is left as it is; this run goes to {tmp_path / 'r-2'}" in out.stdout
    assert f"run directory: {tmp_path / 'r-2'}" in out.stdout
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # a dry run makes nothing


def test_the_next_free_name_skips_directories_that_hold_runs(tmp_path):
    (tmp_path / "r").mkdir()
    assert not holds_run(tmp_path / "r")  # an empty directory holds no run: resume=never uses it
    for name, marker in (("r", "metrics.jsonl"), ("r-2", "resolved.yaml"), ("r-3", "checkpoints")):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / marker).touch()
    (tmp_path / "r-4").mkdir()
    assert unused_sibling(tmp_path / "r") == tmp_path / "r-4"
    run_dir, problems, said = resume_check(tmp_path, "resume=never")
    assert (run_dir, problems) == (tmp_path / "r-4", []) and "this run goes to" in said


def test_resume_never_in_a_reused_sweep_point_is_refused(tmp_path):
    run_with_checkpoint(tmp_path)
    run_dir, problems, _ = resume_check(tmp_path, "resume=never", sweep_point=True)
    assert run_dir == tmp_path / "r" and [p.keys for p in problems] == [("resume",)]
    assert "set hydra.sweep.dir=<a new directory>" in str(problems[0])


# ---- a resume keeps the schedule, model, data and algorithm ------------------------------------------------------
def test_a_resume_that_changes_the_schedule_is_refused_with_the_diff_before_anything_starts(tmp_path):
    run = run_with_checkpoint(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra in (("dry_run=true",), ()):  # dry run or real run: refused in pre-flight, exit 2
        out = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=8", "train.lr=1e-4", "tracking.wandb=true",
                     *extra)
        assert out.returncode == 2, out.stderr
        assert (f"resume from {run / 'checkpoints' / 'step_000006'}: 2 key(s) differ from the run's config "
                f"({run / 'resolved.yaml'}):\n  train.lr: 0.0002 -> 0.0001\n  num_steps: 6 -> 8\n") in out.stderr
        assert "slime_hydra: 1 config problem:\n  - [train.lr, num_steps] changed on resume" in out.stderr
        assert "resume_allow_changes=true" in out.stderr and "tracking.wandb" not in out.stderr  # free to change
        assert "Traceback" not in out.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # no launch recorded, nothing run


def test_an_allowed_change_is_listed_with_the_learning_rate_jump(tmp_path):
    """tiny: 2e-4 decaying linearly to 2e-5 over the run. At step 6 of 6 the rate is 2e-5; 6 of 8 at a 1e-4 peak
    gives 2e-5 + (1e-4 - 2e-5) x 2/8 = 4e-5."""
    run_with_checkpoint(tmp_path)
    out = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=8", "train.lr=1e-4", "resume_allow_changes=true",
                 "dry_run=true")
    assert out.returncode == 0, out.stderr
    assert "with resume_allow_changes=true: 2 key(s) differ from the run's config" in out.stdout
    assert ("  train.lr: 0.0002 -> 0.0001\n  num_steps: 6 -> 8\n  the learning rate at step 7: 2e-05 -> 4e-05\n"
            in out.stdout)
    # PPO's critic follows the same schedule from its own peak: 1e-4 -> 2e-5 + 8e-5 x 2/8 = 4e-5 as well
    _, problems, said = resume_check(tmp_path, "num_steps=8", "train.lr=1e-4", "train.critic_lr=1e-4",
                                     "resume_allow_changes=true", "algo=ppo")
    assert problems == [] and "the learning rate at step 7: 2e-05 -> 4e-05 (critic: 2e-05 -> 4e-05)" in said
    assert "algo.name: grpo -> ppo" in said


def test_keys_that_may_change_on_resume_pass_silently(tmp_path):
    run_with_checkpoint(tmp_path)
    free = ("tracking.wandb=true", "tracking.log_every_steps=2", "save_every_steps=1", "save_every_minutes=5",
            "keep_checkpoints=1", "rollout.eval_every_steps=3", "cluster.mem_gb=64", "train.micro_batch_samples=16",
            "stall_after_minutes=0", "export_at_end=false")
    assert resume_check(tmp_path, "num_steps=6", *free) == (tmp_path / "r", [], "")
    # the same command again, unchanged: no diff
    assert resume_check(tmp_path, "num_steps=6") == (tmp_path / "r", [], "")


@pytest.mark.parametrize("overrides,keys", [
    (("num_steps=6", "model=small"), None),  # the model: many keys at once
    (("num_steps=6", "algo.eps_clip=0.3"), ("algo.eps_clip",)),
    (("num_steps=6", "data.seed=7"), ("data.seed",)),
    (("num_steps=6", "rollout.temperature=0.7"), ("rollout.temperature",)),
    (("num_steps=6", "train.lr_warmup_steps=2"), ("train.lr_warmup_steps",)),
    (("num_steps=9", "train.lr_decay_style=cosine"), ("train.lr_decay_style", "num_steps")),
])
def test_the_model_data_algorithm_and_schedule_are_guarded(tmp_path, overrides, keys):
    run_with_checkpoint(tmp_path)
    _, problems, _ = resume_check(tmp_path, *overrides)
    assert len(problems) == 1 and "changed on resume" in problems[0].message
    if keys is None:
        assert {"model.name", "model.hidden_size", "model.num_layers"} <= set(problems[0].keys)
    else:
        assert problems[0].keys == keys


def test_num_steps_is_schedule_only_while_the_rate_decays(tmp_path):
    """With a constant rate num_steps only says where the run stops: extending it is free."""
    run_with_checkpoint(tmp_path, "train.lr_decay_style=constant")
    assert resume_check(tmp_path, "num_steps=20", "train.lr_decay_style=constant")[1] == []
    _, problems, _ = resume_check(tmp_path, "num_steps=20", "train.lr_decay_style=linear")
    assert problems[0].keys == ("train.lr_decay_style", "num_steps")


def test_a_checkpoint_directory_given_is_compared_with_its_own_run(tmp_path):
    run = run_with_checkpoint(tmp_path / "old")
    ckpt = run / "checkpoints" / "step_000006"
    _, problems, _ = resume_check(tmp_path, f"resume={ckpt}", "num_steps=6", "train.lr=3e-4")
    assert problems[0].keys == ("train.lr",)
    # the run, not a checkpoint of it: refused as such (checkpoint.checkpoint_problems), nothing compared
    _, problems, _ = resume_check(tmp_path, f"resume={run}", "num_steps=6", "train.lr=3e-4")
    assert [p.keys for p in problems] == [("resume",)] and "not a checkpoint directory" in str(problems[0])


def test_the_comparison_walks_the_schema_and_skips_keys_one_side_lacks():
    keys = list(schema_keys())
    assert "train.lr" in keys and "rollout.sglang" in keys and "train.lora.rank" in keys and "data.eval" in keys
    assert "resume_allow_changes" in keys and not [k for k in keys if k.startswith("hydra")]
    old = {"num_steps": 6, "train": {"lr": 1e-4}, "rollout": {"sglang": {}}}
    new = {"num_steps": 6, "train": {"lr": 1e-4, "min_lr": 0.0}, "rollout": {"sglang": {"mem_fraction_static": 0.7}},
           "resume_allow_changes": True}
    assert config_changes(old, new) == [("rollout.sglang", {}, {"mem_fraction_static": 0.7})]  # passthrough: whole
    assert all(key in keys or key.rstrip(".") in {k.split(".")[0] for k in keys} for key in FREE_ON_RESUME)


# ---- every launch keeps its provenance ---------------------------------------------------------------------------
def test_every_launch_keeps_its_own_config_and_the_top_level_is_the_latest(tmp_path):
    run = tmp_path / "r"
    first = write_provenance(run, compose(["num_steps=6"]), ["num_steps=6"], "plan 6")
    second = write_provenance(run, compose(["num_steps=8"]), ["num_steps=8", "resume_allow_changes=true"], "plan 8")
    assert launch_folders(run) == [first, second]
    assert [p.name[:4] for p in (first, second)] == ["001-", "002-"]
    assert sorted(p.name for p in first.iterdir()) == ["git.diff", "git.txt", "overrides.yaml", "plan.txt",
                                                       "resolved.yaml", "versions.json"]
    assert (first / "plan.txt").read_text() == "plan 6" and (run / "plan.txt").read_text() == "plan 8"
    assert OmegaConf.load(first / "resolved.yaml").num_steps == 6 and OmegaConf.load(first / "overrides.yaml") == [
        "num_steps=6"]
    assert OmegaConf.load(second / "resolved.yaml").num_steps == 8
    for name in ("resolved.yaml", "overrides.yaml", "git.txt", "versions.json"):  # the top level: the latest
        assert (run / name).read_text() == (second / name).read_text()
    assert load_run_config(run).num_steps == 8 and not list(run.glob("*.tmp"))


def test_a_run_directory_from_before_launches_keeps_its_first_launch(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "resolved.yaml").write_text(OmegaConf.to_yaml(compose(["num_steps=6"]), resolve=True))
    (run / "overrides.yaml").write_text("- num_steps=6\n")
    latest = write_provenance(run, compose(["num_steps=7"]), ["num_steps=7"], "plan 7")
    earlier, now = launch_folders(run)
    assert now == latest and earlier.name.startswith("001-") and now.name.startswith("002-")
    assert OmegaConf.load(earlier / "resolved.yaml").num_steps == 6 and (earlier / "overrides.yaml").exists()
    assert not (earlier / "git.txt").exists()  # what the old directory had, nothing made up
    assert OmegaConf.load(run / "resolved.yaml").num_steps == 7


# ---- metrics.jsonl -----------------------------------------------------------------------------------------------
def rows(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "train/lr": 1e-4}) + "\n" for s in steps)


def test_a_resume_drops_the_rows_after_its_checkpoint_and_a_half_written_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(rows(0, 1, 2, 3, 4) + '{"step": 5, "train/l')
    tracker.Tracker(TrackingConfig(), tmp_path, "r", {}, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == rows(0, 1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left


def test_the_rewrite_is_atomic_a_crash_leaves_the_whole_history(tmp_path, monkeypatch):
    """The rename is the commit point: a crash before it (here: the rename fails) leaves every row; the old code
    truncated the file in place first."""
    history = rows(0, 1, 2, 3, 4)
    (tmp_path / "metrics.jsonl").write_text(history)

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(tracker.os, "replace", crash)
    with pytest.raises(OSError, match="killed before the rename"):
        tracker.Tracker(TrackingConfig(), tmp_path, "r", {}, resume_step=1)
    assert (tmp_path / "metrics.jsonl").read_text() == history
    assert (tmp_path / "metrics.jsonl.tmp").read_text() == rows(0, 1)  # what the rename would have committed


def test_nothing_to_drop_rewrites_nothing(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(rows(0, 1, 2))
    monkeypatch.setattr(tracker, "replace_durably", lambda path, text: pytest.fail("rewrote an intact history"))
    tracker.Tracker(TrackingConfig(), tmp_path, "r", {}, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == rows(0, 1, 2)
