"""checkpoint.py's manifest: written last by ``complete``; a resume verifies it, passes over a damaged checkpoint to the
newest intact one (saying which and why), refuses with exit 2 when none is intact, and sets aside the folders of
saves that never finished, which ``prune`` does not count."""

import json
import os
import zlib
from pathlib import Path

import pytest

from slime_hydra.checkpoint import (MANIFEST, PARTIAL, Checkpoints, checkpoint_dir, checkpoint_problems, complete,
                                    damage, find_resume, mark_latest, prune)
from slime_hydra.durable import write_json
from slime_hydra.options import ConfigError

PAYLOAD = b"0123456789"


def _write(run, step):
    """A checkpoint's files as a save leaves them before ``complete``: 10 bytes of trainer state, loop.json."""
    ckpt = checkpoint_dir(run, step)
    (ckpt / "actor" / "dcp").mkdir(parents=True)
    (ckpt / "actor" / "dcp" / "__0_0.distcp").write_bytes(PAYLOAD)
    write_json(ckpt / "loop.json", {"step": step, "rollouts_ahead": []})
    return ckpt


def _saved(run, *steps, keep=0):
    return [_complete(run, step, keep) for step in steps]


def _complete(run, step, keep=0):
    ckpt = _write(run, step)
    complete(run, ckpt, keep)
    return ckpt


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_complete_writes_the_manifest_last_then_latest(tmp_path):
    ckpt = _complete(tmp_path, 2)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    loop = (ckpt / "loop.json").read_bytes()
    assert manifest["files"] == {
        "actor/dcp/__0_0.distcp": {"bytes": 10, "crc32": f"{zlib.crc32(PAYLOAD):08x}"},
        "loop.json": {"bytes": len(loop), "crc32": f"{zlib.crc32(loop):08x}"}}
    assert manifest["crc32_seconds"] >= 0
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert _names(tmp_path / "checkpoints") == ["latest", "step_000002"]  # no temp file left
    assert damage(ckpt) == []


def test_damage_names_each_wrong_file_sizes_first(tmp_path):
    ckpt = _complete(tmp_path, 2)
    shard = ckpt / "actor" / "dcp" / "__0_0.distcp"
    shard.write_bytes(b"01234")
    assert damage(ckpt) == ["actor/dcp/__0_0.distcp: 5 bytes, manifest says 10"]
    shard.write_bytes(b"0123456780")  # same size, one byte changed: only the checksum sees it
    assert damage(ckpt, checksums=False) == []
    assert damage(ckpt) == [f"actor/dcp/__0_0.distcp: CRC-32 {zlib.crc32(b'0123456780'):08x}, manifest says "
                            f"{zlib.crc32(PAYLOAD):08x}"]
    shard.unlink()
    size = (ckpt / "loop.json").stat().st_size
    (ckpt / "loop.json").write_text("{}")
    assert damage(ckpt) == ["actor/dcp/__0_0.distcp: missing", f"loop.json: 2 bytes, manifest says {size}"]
    (ckpt / MANIFEST).write_text('{"files": ')
    assert damage(ckpt)[0].startswith(f"{MANIFEST} unreadable (JSONDecodeError")
    (ckpt / MANIFEST).unlink()
    assert damage(ckpt) == [f"no {MANIFEST}: its save (or its deletion) did not finish, or it was written before "
                            "manifests"]


def test_auto_resume_passes_over_damaged_checkpoints_to_the_newest_intact_one(tmp_path, capsys):
    two, four, six = _saved(tmp_path, 2, 4, 6)
    (six / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"01234")
    (four / "loop.json").unlink()
    (six / "loop.json").write_text("{}")
    assert find_resume("auto", tmp_path) == two
    assert capsys.readouterr().out.splitlines() == [
        f"resuming from step_000002: {six} is damaged (actor/dcp/__0_0.distcp: 5 bytes, manifest says 10 "
        "(and 1 more files))",
        f"resuming from step_000002: {four} is damaged (loop.json: missing)"]
    assert checkpoint_problems("auto", tmp_path) == []


def test_no_intact_checkpoint_refuses_with_exit_2_naming_each_damage(tmp_path, capsys):
    two, four = _saved(tmp_path, 2, 4)
    for ckpt in (two, four):
        (ckpt / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"0123")
    with pytest.raises(ConfigError) as error:
        find_resume("auto", tmp_path)
    assert error.value.exit_code == 2 and capsys.readouterr().out == ""
    assert [(p.keys, p.message) for p in error.value.problems] == [
        (("resume",), f"resume=auto: no intact checkpoint; {ckpt} is damaged (actor/dcp/__0_0.distcp: 4 bytes, "
                      "manifest says 10)") for ckpt in (four, two)]
    assert error.value.problems[0].fix == ("resume=never starts fresh; resume=<run_dir>/checkpoints/step_NNNNNN picks "
                                           "one")
    assert checkpoint_problems("auto", tmp_path) == error.value.problems  # sizes only: the same here
    assert find_resume("never", tmp_path) is None


def test_a_checksum_error_is_found_by_the_loop_not_by_the_sizes_only_preflight(tmp_path):
    (two,) = _saved(tmp_path, 2)
    (two / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"9123456789")
    assert checkpoint_problems("auto", tmp_path) == []
    assert len(checkpoint_problems("auto", tmp_path, checksums=True)) == 1
    with pytest.raises(ConfigError, match="CRC-32"):
        find_resume("auto", tmp_path)


def test_latest_naming_a_missing_folder_falls_back(tmp_path, capsys):
    two, four = _saved(tmp_path, 2, 4)
    four.rename(tmp_path / "elsewhere")
    assert find_resume("auto", tmp_path) == two
    assert capsys.readouterr().out == f"resuming from step_000002: {four} is damaged (missing; latest names it)\n"


def test_an_explicit_checkpoint_is_verified(tmp_path, capsys):
    (two,) = _saved(tmp_path, 2)
    assert find_resume(str(two), tmp_path / "another_run") == two
    (two / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"0")
    with pytest.raises(ConfigError) as error:
        find_resume(str(two), tmp_path)
    assert str(error.value.problems[0]) == (
        f"[resume] resume={two} is damaged (actor/dcp/__0_0.distcp: 1 bytes, manifest says 10); resume=auto takes "
        "the run's newest intact checkpoint; resume=never starts fresh")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        find_resume(str(tmp_path / "nothing"), tmp_path)
    assert [p.keys for p in checkpoint_problems(str(tmp_path / "nothing"), tmp_path)] == [("resume",)]
    (two / MANIFEST).unlink()  # written before manifests: taken unverified
    assert find_resume(str(two), tmp_path) == two
    assert "has no manifest.json (written before manifests): resuming unverified" in capsys.readouterr().out


def test_a_checkpoint_from_before_manifests_resumes_when_latest_names_it(tmp_path, capsys):
    old = _write(tmp_path, 4)
    mark_latest(tmp_path, old)
    assert find_resume("auto", tmp_path) == old
    assert capsys.readouterr().out == f"warning: {old} has no {MANIFEST} (written before manifests): resuming " \
                                      "unverified\n"


def test_saves_that_never_finished_are_not_resumed_set_aside_at_the_start_and_not_pruned(tmp_path):
    folder = tmp_path / "checkpoints"
    _write(tmp_path, 2)  # no latest at all: the first save never finished
    assert find_resume("auto", tmp_path) is None
    assert Checkpoints(tmp_path, keep=1).resume_from("auto") is None
    assert _names(folder) == [PARTIAL] and _names(folder / PARTIAL)[0].startswith("step_000002-")
    two, four = _saved(tmp_path, 2, 4)
    _write(tmp_path, 6)  # crashed mid-save: no manifest, newer than latest
    _write(tmp_path, 8)
    assert prune(tmp_path, keep=1) == [two]  # only what latest names and older counts
    assert find_resume("auto", tmp_path) == four
    assert Checkpoints(tmp_path, keep=1).resume_from("auto") == four
    assert _names(folder) == ["latest", PARTIAL, "step_000004"]
    assert [n.split("-")[0] for n in _names(folder / PARTIAL)] == ["step_000006", "step_000008"]  # step 2's: gone


def test_a_resume_past_damaged_checkpoints_sets_them_aside_and_moves_latest(tmp_path, capsys):
    two, four, six = _saved(tmp_path, 2, 4, 6)
    (four / MANIFEST).unlink()
    (six / "loop.json").write_text("{}")
    checkpoints = Checkpoints(tmp_path, keep=2)
    assert checkpoints.resume_from("auto") == two
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert [n.split("-")[0] for n in _names(tmp_path / "checkpoints" / PARTIAL)] == ["step_000004", "step_000006"]
    assert "set aside step_000006" in capsys.readouterr().out
    assert find_resume("auto", tmp_path) == two and capsys.readouterr().out == ""  # nothing damaged is left


def test_a_save_into_an_existing_folder_starts_empty(tmp_path):
    (two,) = _saved(tmp_path, 2)
    checkpoints = Checkpoints(tmp_path, keep=0)
    assert checkpoints.begin(2) == two and list(two.iterdir()) == []
    assert [n.split("-")[0] for n in _names(tmp_path / "checkpoints" / PARTIAL)] == ["step_000002"]


def test_the_loop_completes_a_checkpoint_in_a_thread_and_reports_its_error(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=1)
    two = _write(tmp_path, 2)
    assert not checkpoints.completing(two)
    assert checkpoints.complete(two, wait=True) and not checkpoints.completing(two)
    assert damage(two) == [] and find_resume("auto", tmp_path) == two
    four = _write(tmp_path, 4)
    done = checkpoints.complete(four)
    assert checkpoints.completing(four) != done  # started: running, or done and reported
    assert done or checkpoints.complete(four, wait=True)
    assert _names(tmp_path / "checkpoints") == ["latest", "step_000004"]  # keep=1 pruned step 2
    with pytest.raises(RuntimeError, match="completing checkpoint .*step_000009 failed") as error:
        checkpoints.complete(checkpoint_dir(tmp_path, 9), wait=True)  # never written
    assert isinstance(error.value.__cause__, FileNotFoundError)


def test_without_latest_a_checkpoint_with_a_manifest_is_complete(tmp_path, capsys):
    """A crash between a manifest and the first ``latest``: that checkpoint is complete, and taken."""
    two, four = _saved(tmp_path, 2, 4)
    (tmp_path / "checkpoints" / "latest").unlink()
    (four / "loop.json").write_text("{}")
    _write(tmp_path, 6)
    assert Checkpoints(tmp_path, keep=0).resume_from("auto") == two
    assert f"resuming from step_000002: {four} is damaged (loop.json: 2 bytes" in capsys.readouterr().out
    assert _names(tmp_path / "checkpoints") == ["latest", PARTIAL, "step_000002"]
    assert [n.split("-")[0] for n in _names(tmp_path / "checkpoints" / PARTIAL)] == ["step_000004", "step_000006"]


def test_an_explicit_checkpoint_that_never_finished_is_kept_where_it_is(tmp_path):
    _saved(tmp_path, 2)
    six = _write(tmp_path, 6)
    relative = os.path.relpath(six)
    assert Checkpoints(tmp_path, keep=0).resume_from(relative) == Path(relative) and six.is_dir()
