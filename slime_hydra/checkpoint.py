"""Run checkpoints: everything needed to continue a run exactly where it stopped.

Layout (``k`` = rollout steps completed)::

    <run_dir>/checkpoints/step_000040/
        actor/            the trainer's resumable checkpoint (model, optimizer, scheduler, RNG, step; backend's own)
        critic/           PPO only
        rollout.json      the prompt cursor and the buffer (RolloutManager.state_dict)
        loop.json         {"step": k, "rollouts_ahead": [...]}  (the engines' weight version after a resume is k)
        manifest.json     written last: every other file's relative path, size in bytes and CRC-32
    <run_dir>/checkpoints/latest     the name of the newest complete checkpoint
    <run_dir>/checkpoints/partial/   folders set aside, never resumed from (step_000044-20260512-101500)
    <run_dir>/export/step_000200/    the policy as an HF checkpoint (a finished run's last step; export.py any step)

A checkpoint is complete once its manifest exists. ``complete`` reads every file back (size, CRC-32, fsync), writes
``manifest.json`` (temp file + rename, fsynced), fsyncs the folders up to the run directory and only then points
``latest`` at it (temp file + rename), so a crash during a save leaves the previous checkpoint as the newest. With
``checkpoint_in_background`` (the default) the trainer ranks copy their state to host memory and write their files
from a thread (train/checkpoint_writer.py) while the run goes on; the loop writes rollout.json and loop.json of the
same step at once, and completes the checkpoint (``Checkpoints.complete``, a thread of the driver) from a later step
boundary, once every rank reported its files fsynced; a save first waits for the previous one. When to save:
``save_every_steps``, ``save_every_minutes`` since the last save, the end of the run, a signal (these last two wait
for the write); ``keep_checkpoints`` newest are kept, older ones deleted once a newer one is complete (``prune``). In
async mode the rollouts already started for the next steps are finished and kept in ``loop.json``
(``rollouts_ahead``), so no sample is lost or generated twice.

The checksum is CRC-32 (``zlib.crc32``: 2.5 GB/s on one core of the busy 2-core CPU test machine, where SHA-1 does
1.5 GB/s and MD5 or BLAKE2b 0.6; with the files read back from the page cache, 0.4-1.0 GB/s, 1 GiB in 1.1-2.5 s): it
finds a truncated, missing or corrupted file, not tampering (a checkpoint is trusted like code anyway, docs/loop.md).
The driver computes it in a thread of its own, polled at step boundaries like the ranks' writes, so a step waits for
it only at the saves that wait for their write (the end, a signal): a 30 GB checkpoint is 30-75 s of one driver core
beside steps that go on. Not in the ranks' writer threads: they write the backend's own files (DCP names its own),
so the driver checksums what is on disk, which is also what a resume verifies.

``resume``: ``auto`` walks the checkpoints from the one ``latest`` names to older ones and takes the first intact one:
a manifest, and every file it lists with its size (a stat each: under 1 ms) and its CRC-32 (a read of the whole
checkpoint: 13-36 ms for the tests' 10 MB, 1.1 s per GiB). Each damaged one passed over is printed (``resuming from
step_000002: <run_dir>/checkpoints/step_000004 is damaged (actor/dcp/__0_0.distcp: 1234 bytes, manifest says
5678)``), set aside when the run starts, and ``latest`` then names the one resumed from. Checkpoints there but none
intact: a ConfigError (exit 2) naming each one's damage. None there (or only saves that never finished): a fresh
start. ``never`` always starts fresh; anything else is a checkpoint directory to start from, refused if damaged. A
checkpoint without a manifest, written before manifests existed, is resumed from unverified (with a warning) when
``latest`` or ``resume=<dir>`` names it, and is damaged otherwise. A launch's pre-flight check
(``checkpoint_problems``) compares sizes only; the loop verifies the checksums when it starts.

A ``step_*`` folder newer than ``latest`` without a manifest is a save that never finished: never resumed from,
not counted by ``prune``, and set aside into ``checkpoints/partial/`` when a run starts (``Checkpoints.resume_from``),
as is a folder a new save would reuse (``Checkpoints.begin``). Set aside rather than deleted: a rename is instant at
any size and keeps a damaged checkpoint for a look; each set-aside deletes what the previous one left in ``partial/``,
so it holds at most the folders of one.
"""

import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Optional

from slime_hydra.durable import fsync_path, replace_durably, write_json
from slime_hydra.options import ConfigError, Problem

LATEST = "latest"
MANIFEST = "manifest.json"
"""<ckpt>/manifest.json: {"files": {relative path: {"bytes": size, "crc32": 8 hex digits}}, "crc32_seconds": ...}."""
PARTIAL = "partial"
"""<run_dir>/checkpoints/partial/: the checkpoint folders set aside by the latest set-aside (set_aside)."""
RUN_RECORD = "run.json"
"""<run_dir>/run.json: the driver's host, pid and start time, then how the run ended (loop.run writes it)."""
JOB_ERROR = "{job_id}_{rank}_error.json"
"""In a SLURM job's submitit folder, beside submitit's own per-task files: why that task failed, as JSON
(launch/submit.py writes it, status.py shows it)."""
CHUNK_BYTES = 8 << 20
"""Files are read back in chunks of this size to checksum them."""
PICK_FIX = "resume=never starts fresh; resume=<run_dir>/checkpoints/step_NNNNNN picks one"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def export_dir(run_dir: Path, step: int) -> Path:
    """Where the HF export of checkpoint ``step_<N>`` goes (the run's own at its end, or export.py's)."""
    return Path(run_dir) / "export" / f"step_{step:06d}"


def mark_latest(run_dir: Path, ckpt: Path) -> None:
    """Point ``latest`` at ckpt (atomic rename, flushed to disk)."""
    replace_durably(Path(run_dir) / "checkpoints" / LATEST, ckpt.name + "\n")


def _checksum(path: Path, buffer: memoryview, fsync: bool = False) -> tuple[int, int]:
    """(bytes, CRC-32) of a file read back in chunks; ``fsync``: also flush it to disk, being open anyway."""
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc, size = zlib.crc32(buffer[:n], crc), size + n
        if fsync:
            os.fsync(f.fileno())
    return size, crc


def complete(run_dir: Path, ckpt: Path, keep: int) -> None:
    """ckpt is written (every trainer rank's files fsynced): read back every file (its size and CRC-32; an fsync),
    flush its folders, write ``manifest.json`` (atomic, flushed), flush the folders up to the run directory, point
    ``latest`` at it, prune."""
    began, buffer, files = time.perf_counter(), memoryview(bytearray(CHUNK_BYTES)), {}
    for folder, _, names in os.walk(ckpt):
        for name in names:
            rel = (Path(folder) / name).relative_to(ckpt).as_posix()
            if rel != MANIFEST:
                size, crc = _checksum(Path(folder) / name, buffer, fsync=True)
                files[rel] = {"bytes": size, "crc32": f"{crc:08x}"}
        fsync_path(Path(folder))
    write_json(ckpt / MANIFEST, {"files": dict(sorted(files.items())),
                                 "crc32_seconds": round(time.perf_counter() - began, 3)})
    fsync_path(ckpt.parent)  # the step folder's entry in checkpoints/
    fsync_path(Path(run_dir))  # checkpoints/' entry in the run directory
    mark_latest(run_dir, ckpt)
    prune(run_dir, keep)


def damage(ckpt: Path, checksums: bool = True) -> list[str]:
    """What is wrong with checkpoint ckpt against its manifest, one entry per file; empty: intact. Every file's size
    first (a stat each), then, only if all match and ``checksums``, every file's CRC-32 (a read of the whole
    checkpoint). Files the manifest does not list are not checked."""
    try:
        listed = {str(rel): (int(want["bytes"]), str(want["crc32"]))
                  for rel, want in json.loads((ckpt / MANIFEST).read_text())["files"].items()}
    except FileNotFoundError:
        return [f"no {MANIFEST}: its save (or its deletion) did not finish, or it was written before manifests"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return [f"{MANIFEST} unreadable ({type(error).__name__}: {error})"]
    wrong = []
    for rel, (size, _) in listed.items():
        try:
            found = (ckpt / rel).stat().st_size
        except OSError as error:
            wrong.append(f"{rel}: {'missing' if isinstance(error, FileNotFoundError) else error.strerror}")
            continue
        if found != size:
            wrong.append(f"{rel}: {found} bytes, manifest says {size}")
    if wrong or not checksums:
        return wrong
    buffer = memoryview(bytearray(CHUNK_BYTES))
    for rel, (_, crc) in listed.items():
        try:
            found = f"{_checksum(ckpt / rel, buffer)[1]:08x}"
        except OSError as error:
            wrong.append(f"{rel}: unreadable ({error.strerror})")
            continue
        if found != crc:
            wrong.append(f"{rel}: CRC-32 {found}, manifest says {crc}")
    return wrong


def _one_line(wrong: list[str]) -> str:
    return wrong[0] + (f" (and {len(wrong) - 1} more files)" if len(wrong) > 1 else "")


def _latest_name(folder: Path) -> Optional[str]:
    try:
        name = (folder / LATEST).read_text().strip()
    except OSError:
        return None
    return name or None


def _steps(folder: Path) -> list[Path]:
    """The step_* folders, newest first."""
    return sorted((p for p in folder.glob("step_*") if p.is_dir()), reverse=True) if folder.is_dir() else []


def _choose(resume: str, run_dir: Path, checksums: bool) -> tuple[Optional[Path], list[str]]:
    """(the checkpoint to resume from or None, the lines to print); raises what find_resume raises."""
    if resume == "never":
        return None, []
    if resume != "auto":
        path = Path(resume)
        if not (path / "loop.json").exists():
            raise FileNotFoundError(f"resume={resume}: not a checkpoint directory (no loop.json); give "
                                    "<run_dir>/checkpoints/step_NNNNNN, or resume=auto")
        if not (path / MANIFEST).exists():
            return path, [f"warning: {path} has no {MANIFEST} (written before manifests): resuming unverified"]
        if wrong := damage(path, checksums):
            raise ConfigError([Problem(("resume",), f"resume={resume} is damaged ({_one_line(wrong)})",
                                       "resume=auto takes the run's newest intact checkpoint; resume=never starts "
                                       "fresh")])
        return path, []
    folder = Path(run_dir) / "checkpoints"
    latest = _latest_name(folder)
    damaged = [] if latest is None or (folder / latest).is_dir() else [(folder / latest, "missing; latest names it")]
    for ckpt in _steps(folder):
        if (latest is None and not (ckpt / MANIFEST).exists()) or (latest is not None and ckpt.name > latest):
            continue  # a save that never finished (no manifest), or one newer than latest: never resumed from
        if ckpt.name == latest and not (ckpt / MANIFEST).exists():
            return ckpt, [f"warning: {ckpt} has no {MANIFEST} (written before manifests): resuming unverified"]
        if not (wrong := damage(ckpt, checksums)):
            return ckpt, [f"resuming from {ckpt.name}: {path} is damaged ({what})" for path, what in damaged]
        damaged.append((ckpt, _one_line(wrong)))
    if damaged:
        raise ConfigError([Problem(("resume",), f"resume=auto: no intact checkpoint; {path} is damaged ({what})",
                                   PICK_FIX) for path, what in damaged])
    return None, []


def find_resume(resume: str, run_dir: Path, checksums: bool = True, quiet: bool = False) -> Optional[Path]:
    """The checkpoint directory to resume from, or None to start fresh (see the module docstring); prints a line
    for each damaged checkpoint it passes over. Raises a ConfigError (exit 2) naming the damage when checkpoints are
    there but none is intact, or ``resume=<dir>`` names a damaged one; a FileNotFoundError when ``<dir>`` is no
    checkpoint. ``checksums``: verify every file's CRC-32 too, not only its size (a read of each checkpoint it
    verifies). ``quiet``: print nothing (a launch's pre-flight; the loop prints them)."""
    ckpt, lines = _choose(resume, Path(run_dir), checksums)
    for line in lines if not quiet else ():
        print(line, flush=True)
    return ckpt


def checkpoint_problems(resume: str, run_dir: Path, checksums: bool = False) -> list[Problem]:
    """What refuses ``resume`` (find_resume's errors, as problems, nothing printed), for a launch's pre-flight check
    before Ray starts. Sizes only by default: a stat per file, instant at any size and on a login node; the loop
    verifies the checksums too when it starts."""
    try:
        _choose(resume, Path(run_dir), checksums)
    except FileNotFoundError as error:
        return [Problem(("resume",), str(error))]
    except ConfigError as error:
        return error.problems
    return []


def set_aside(paths: list[Path]) -> list[Path]:
    """Move checkpoint folders out of the way, to ``checkpoints/partial/<name>-<time>`` (a rename: instant at any
    size), after deleting what an earlier set-aside left there: the newest ones stay for a look, and the disk holds
    at most those. Returns where they went."""
    if not paths:
        return []
    partial = paths[0].parent / PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [partial / f"{path.name}-{stamp}" for path in paths]
    for path, target in zip(paths, moved):
        os.replace(path, target)
        print(f"checkpoints: set aside {path.name} -> {target} (never resumed from; delete it to free the space)",
              flush=True)
    fsync_path(partial)
    fsync_path(paths[0].parent)
    return moved


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints up to the one ``latest`` names (never that one; newer folders
    are a save in progress or one that never finished, not counted); returns what was deleted. keep=0 deletes
    nothing. A folder loses its manifest first, so one half deleted (a crash) is never taken for a checkpoint."""
    folder = Path(run_dir) / "checkpoints"
    latest = _latest_name(folder)
    if keep <= 0 or latest is None:
        return []
    old = [p for p in _steps(folder) if p.name <= latest][keep:]
    for path in old:
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return old


class Checkpoints:
    """The run's checkpoints as the loop uses them: where to resume from, a fresh folder for each save, and the
    completion of a save (``complete``: checksums, manifest, ``latest``, prune) in a thread, polled at step
    boundaries like the trainer ranks' writes."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir, self.folder, self.keep = Path(run_dir), Path(run_dir) / "checkpoints", keep
        self._ckpt: Optional[Path] = None  # being completed, or completed and not yet reported
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def resume_from(self, resume: str) -> Optional[Path]:
        """find_resume, then, before anything is saved, set aside what will never be resumed from: folders newer
        than ``latest`` without a manifest (saves that never finished), and with ``resume=auto`` the damaged ones it
        passed over; ``latest`` then names the checkpoint resumed from."""
        ckpt = find_resume(resume, self.run_dir)
        latest, kept = _latest_name(self.folder), ckpt.resolve() if ckpt is not None else None
        fell_back = resume == "auto" and ckpt is not None and ckpt.name != latest
        set_aside([p for p in _steps(self.folder) if p.resolve() != kept and (
            (fell_back and p.name > ckpt.name and (latest is None or p.name <= latest))  # damaged: passed over
            or (not (p / MANIFEST).exists() and (latest is None or p.name > latest)))])  # saves never finished
        if fell_back:
            mark_latest(self.run_dir, ckpt)
        return ckpt

    def begin(self, step: int) -> Path:
        """An empty folder for checkpoint ``step``: one already there (from before a resume to an older checkpoint)
        is set aside first, so no file of it stays under a new manifest."""
        ckpt = checkpoint_dir(self.run_dir, step)
        if ckpt.exists():
            set_aside([ckpt])
        ckpt.mkdir(parents=True)
        return ckpt

    def completing(self, ckpt: Path) -> bool:
        """Whether ``complete(ckpt)`` started (and was not reported done yet)."""
        return self._ckpt == ckpt

    def complete(self, ckpt: Path, wait: bool = False) -> bool:
        """Complete ckpt (module function ``complete``) in a thread started at the first call; True once done (then
        ``latest`` names it), False while it runs (``wait``: block until it ends). Raises the thread's error."""
        if self._ckpt != ckpt:
            self._ckpt, self._error = ckpt, None
            self._thread = threading.Thread(target=self._complete, args=(ckpt,), name="checkpoint-complete",
                                            daemon=True)
            self._thread.start()
        assert self._thread is not None
        if wait:
            self._thread.join()
        if self._thread.is_alive():
            return False
        self._ckpt = None
        if self._error is not None:
            raise RuntimeError(f"completing checkpoint {ckpt} failed") from self._error
        return True

    def _complete(self, ckpt: Path) -> None:
        try:
            complete(self.run_dir, ckpt, self.keep)
        except BaseException as error:  # reported by complete(), in the loop's thread
            self._error = error
