"""Crash-safe writes: a reader sees the old content or the new, never a torn file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    write_bytes(path, dump_json(obj).encode())


def dump_json(obj: Any) -> str:
    # allow_nan: losses can legitimately be NaN in a broken run, and we must be able to store that run.
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=True) + "\n"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def replace_dir(staged: Path, target: Path) -> None:
    """Swap a fully written staging directory into place.

    The old directory is renamed aside first and removed only once the new one is in place,
    so an interruption leaves either the old or the new reference plus a stray backup, never a mix.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    backup = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    had_old = target.exists()
    if had_old:
        os.replace(target, backup)
    os.replace(staged, target)
    _fsync_dir(target.parent)
    if had_old:
        shutil.rmtree(backup, ignore_errors=True)


def staging_dir_for(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.new-{uuid.uuid4().hex}")
    staged.mkdir()
    return staged
