"""checkpoint.py: retention never removes what ``latest`` names, and keeps the newest ``keep``."""

from slime_hydra.checkpoint import checkpoint_dir, mark_latest, prune
from slime_hydra.durable import write_json


def _save(run, step):
    ckpt = checkpoint_dir(run, step)
    ckpt.mkdir(parents=True)
    write_json(ckpt / "loop.json", {"step": step})
    return ckpt


def test_prune_keeps_the_newest_and_whatever_latest_names(tmp_path):
    for step in (2, 4, 6, 8):
        mark_latest(tmp_path, _save(tmp_path, step))
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step_000002", "step_000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000006", "step_000008"]
    _save(tmp_path, 10)  # a save that did not complete: latest still names step 8
    prune(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000008", "step_000010"]
    assert prune(tmp_path, keep=0) == []
