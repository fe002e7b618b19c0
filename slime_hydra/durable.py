"""Files replaced so that a crash at any moment leaves the old content or the new, whole, on disk.

    replace_durably(path, text)   a temp file beside it, fsynced, renamed over it, then its folder fsynced
    write_json(path, data)        the same for JSON (checkpoint metadata, run.json, a job's error record)
    fsync_path(path)              flush a file's or a folder's entry to disk

A rename is atomic on POSIX filesystems, but only the folder's fsync puts the rename itself on disk: without it a
power loss can bring back the old name. Written here because the standard library has no atomic replace.
"""

import json
import os
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json(path: Path, data: Any) -> None:
    replace_durably(path, json.dumps(data))
