"""Crash-safe writes: a reader sees the old content or the new, never a torn file and never neither.

Leftovers of an interrupted write (``.<name>.new-<id>``, ``.<name>.old-<id>``, ``.<file>.<id>.tmp``)
are found by ``leftovers``; docs/architecture.md, "The reference store", has the design.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
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
    """Swap a fully written staging directory into place: one ``renameat2(RENAME_EXCHANGE)`` where possible (no
    instant without ``target``). A crash before ``staged`` (now the old content) goes leaves a ``.new-*`` leftover."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        os.rename(staged, target)  # nothing to keep: one rename is atomic on its own
    elif exchange(staged, target):
        _fsync_dir(target.parent)
        shutil.rmtree(staged, ignore_errors=True)
        return
    else:
        _swap_with_restore(staged, target)
    _fsync_dir(target.parent)


def _swap_with_restore(staged: Path, target: Path) -> None:
    """Without RENAME_EXCHANGE: two renames, the old directory put back if the second fails. A crash between
    leaves it under ``.<name>.old-<id>`` for ``restore_orphan``; a reader then finds nothing."""
    backup = target.with_name(f".{target.name}{OLD}{uuid.uuid4().hex}")
    os.rename(target, backup)
    try:
        os.rename(staged, target)
    except BaseException:
        os.rename(backup, target)
        raise
    _fsync_dir(target.parent)
    shutil.rmtree(backup, ignore_errors=True)


def staging_dir_for(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}{NEW}{uuid.uuid4().hex}")
    staged.mkdir()
    return staged


# --- renameat2(RENAME_EXCHANGE) ------------------------------------------------------------------

RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}
# The kernel (ENOSYS), the filesystem (EINVAL) or a seccomp sandbox (EPERM, ENOSYS) cannot
# exchange: fall back. A real permission problem then surfaces from the fallback's own rename.
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[[bytes, bytes, int], int] | None:
    """libc's renameat2 (glibc 2.28+), else the raw syscall by number, else None (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return lambda old, new, flags: function(_AT_FDCWD, old, _AT_FDCWD, new, flags)
    number = _SYS_RENAMEAT2.get(platform.machine().lower())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    return lambda old, new, flags: syscall(ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(old),
                                           ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(new), ctypes.c_uint(flags))


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths. False where this kernel, filesystem or OS cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(os.fsencode(a), os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _CANNOT_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# --- leftovers of interrupted writes ----------------------------------------------------------------

NEW = ".new-"  # .<name>.new-<id>: a staging directory, or the old content swapped out by an exchange
OLD = ".old-"  # .<name>.old-<id>: the old content moved aside by the fallback's first rename


def _aside_pattern(target: Path, kinds: str) -> re.Pattern[str]:
    # the exact names replace_dir gives, so another reference whose name holds ".new-" is never matched
    return re.compile(rf"\.{re.escape(target.name)}(?:{kinds})[0-9a-f]{{32}}")


def leftovers(target: Path) -> list[Path]:
    """What interrupted writes of ``target`` left beside it: staging and moved-aside folders, temp files."""
    folder = target.parent
    aside = _aside_pattern(target, f"{re.escape(NEW)}|{re.escape(OLD)}")
    # Globs find nothing in a folder not there. write_bytes' temp files: .<file>.<id>.tmp
    found = [p for p in folder.glob(".*") if aside.fullmatch(p.name)]
    found += [p for where in (folder, target) for p in where.glob(".*.tmp") if p.is_file()]
    return sorted(found)


def remove_leftovers(target: Path) -> list[Path]:
    """Delete ``leftovers(target)``; hold ``locked(target.parent)`` so no live writer's files go."""
    found = leftovers(target)
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def restore_orphan(target: Path) -> Path | None:
    """Put back an old directory a crash left under ``.<name>.old-*`` with no ``target``; return where it was.
    Hold ``locked(target.parent)``: a live fallback writer holds it between its two renames."""
    if target.exists():
        return None
    moved = _aside_pattern(target, re.escape(OLD))
    aside = [p for p in target.parent.glob(".*") if moved.fullmatch(p.name) and p.is_dir()]  # none in a missing folder
    if not aside:
        return None
    newest = max(aside, key=lambda p: p.stat().st_mtime_ns)
    os.rename(newest, target)
    _fsync_dir(target.parent)
    return newest


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on ``folder`` itself (no lock file to commit), released when the process dies. Best
    effort: where flock is missing or refused (some network filesystems), writes go unlocked."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):  # not POSIX, or a folder we may not open: the caller's own access decides
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
