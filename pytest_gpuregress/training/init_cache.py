"""A content-addressed cache of seeded initial weights on disk: a launch after the first reads them.

Keyed by the sha256 of what the values are computed from (seed, name, shape, std, dtype, code identity),
under ``GPUREGRESS_INIT_CACHE`` (or ``off``), else the XDG cache folder. Files are safetensors, renamed
into place and checked against their own hash; a bad one is recomputed, never used. Ranks that miss the
same entries split the work through locks. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

VARIABLE = "GPUREGRESS_INIT_CACHE"
OFF = "off"
TENSOR = "values"  # the one tensor of an entry's file
UNUSED_DAYS = 14.0  # an entry no launch read or wrote for this long is deleted by the next writer
_pruned = threading.Event()  # once per process: the first write prunes
TAGS = {"float32": "F32", "float64": "F64", "float16": "F16"}  # safetensors' names of the dtypes cached
HEADER_LIMIT = 1 << 20  # an entry's header is a few hundred bytes


@dataclass(frozen=True)
class Entry:
    """What one parameter's initial values are computed from (with the code's identity, its cache key)."""

    seed: int
    name: str
    shape: tuple[int, ...]
    std: float
    dtype: str  # numpy's name of the parameter's dtype: float32

    def describe(self) -> str:
        return json.dumps({**asdict(self), "shape": list(self.shape)}, sort_keys=True)


def default_root() -> Path | None:
    """The cache folder: ``$GPUREGRESS_INIT_CACHE``, else under the XDG cache home; None when switched off."""
    chosen = os.environ.get(VARIABLE, "").strip()
    if chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    try:
        home = Path(base) if base else Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found: no cache
        return None
    return home / "pytest-gpuregress" / "init"


def values_digest(values: np.ndarray) -> str:
    """The sha256 of an array's bytes, in C order."""
    return hashlib.sha256(np.ascontiguousarray(values).reshape(-1).view(np.uint8)).hexdigest()


@dataclass(frozen=True)
class InitCache:
    """Entries under ``root``, keyed together with ``code`` (what computes the values: seeding.code_identity)."""

    root: Path
    code: str

    def path(self, entry: Entry) -> Path:
        key = hashlib.sha256(f"{entry.describe()}\n{self.code}".encode()).hexdigest()
        return self.root / key[:2] / f"{key}.safetensors"

    def load_into(self, entry: Entry, out: np.ndarray) -> bool:
        """Read the entry's values into ``out`` (C-contiguous, its dtype and shape): True where the file is whole
        and matching; else False, ``out`` holding anything."""
        path = self.path(entry)
        try:
            with open(path, "rb") as fh:
                meta = _header(fh, entry, out.nbytes)
                if meta is None or meta.get("entry") != entry.describe() or meta.get("code") != self.code:
                    return False
                if fh.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes or fh.read(1):
                    return False
        except (OSError, ValueError):  # missing, unreadable, not JSON: all mean "compute it"
            return False
        if meta.get("sha256") != values_digest(out):
            return False
        with contextlib.suppress(OSError):  # marks it used: prune() keeps what was read lately
            os.utime(path)
        return True

    def load(self, entry: Entry) -> np.ndarray | None:
        """The entry's values, or None where there is no whole, matching file."""
        out = np.empty(entry.shape, dtype=entry.dtype)
        return out if self.load_into(entry, out) else None

    def prune(self) -> int:
        """Delete entries unused for ``UNUSED_DAYS`` (else the cache only grows, 0.6 GB per GPU-size model and seed),
        and temporary files and locks a killed rank left over an hour ago; return how many files went."""
        now, deleted = time.time(), 0
        for path in self.root.glob("*/*"):
            stale = UNUSED_DAYS * 86400 if path.suffix == ".safetensors" else 3600  # else .tmp, .lock
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > stale:
                    path.unlink()
                    deleted += 1
        return deleted

    def store(self, entry: Entry, values: np.ndarray) -> None:
        """Write the entry atomically (a read-only or full cache is just not written); a process's first write prunes."""
        if not _pruned.is_set():
            _pruned.set()
            self.prune()
        path = self.path(entry)
        values = np.ascontiguousarray(values, dtype=np.dtype(entry.dtype).newbyteorder("<"))
        meta = {"entry": entry.describe(), "code": self.code, "sha256": values_digest(values)}
        header = json.dumps({"__metadata__": meta, TENSOR: {"dtype": TAGS[entry.dtype], "shape": list(entry.shape),
                                                           "data_offsets": [0, values.nbytes]}}).encode()
        header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:  # the array's own memory, not a copy in a bytes object
                fh.write(len(header).to_bytes(8, "little") + header)
                fh.write(values.reshape(-1).view(np.uint8).data)
            os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    @contextlib.contextmanager
    def claim(self, entry: Entry, wait: bool) -> Iterator[bool]:
        """Whether this process computes ``entry`` now: True holding its lock (or where there are no locks), False
        where another process holds it and ``wait`` is off."""
        lock = self.path(entry).with_suffix(".lock")
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield True
            return
        try:
            yield _flock(fd, wait)
        finally:
            os.close(fd)  # releases the lock


def _header(fh: BinaryIO, entry: Entry, size: int) -> dict[str, str] | None:
    """The metadata of a safetensors file holding exactly the entry's tensor of ``size`` bytes, positioned at its
    data; None for any other file. Parsed here, not by safetensors, so values go straight into the parameter."""
    head = fh.read(8)
    if len(head) != 8:
        return None
    length = int.from_bytes(head, "little")
    if length > HEADER_LIMIT:
        return None
    header = json.loads(fh.read(length))
    tensor, meta = header.get(TENSOR), header.get("__metadata__")
    if (not isinstance(tensor, dict) or not isinstance(meta, dict) or set(header) != {TENSOR, "__metadata__"}
            or tensor.get("dtype") != TAGS.get(entry.dtype) or tensor.get("shape") != list(entry.shape)
            or tensor.get("data_offsets") != [0, size]):
        return None
    return meta


def _flock(fd: int, wait: bool) -> bool:
    """Take an exclusive lock on ``fd``: False only where another process holds it and ``wait`` is off."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: compute unlocked
        return True
    return True


def fetch(cache: InitCache, entries: Iterable[tuple[Entry, np.ndarray]],
          compute: Callable[[Entry], np.ndarray]) -> None:
    """Fill each entry's array (C-contiguous, its dtype and shape) from the cache, or compute and store it. One
    another process is computing comes last, read once written (computed here if it was not)."""
    later = []
    for entry, out in entries:
        if cache.load_into(entry, out):
            continue
        with cache.claim(entry, wait=False) as mine:
            if mine:
                _load_or_compute(cache, entry, out, compute)
            else:
                later.append((entry, out))
    for entry, out in later:
        with cache.claim(entry, wait=True):
            _load_or_compute(cache, entry, out, compute)


def _load_or_compute(cache: InitCache, entry: Entry, out: np.ndarray, compute: Callable[[Entry], np.ndarray]) -> None:
    """Under the entry's lock: what another process wrote meanwhile, else computed here and stored."""
    if not cache.load_into(entry, out):
        out[...] = compute(entry)
        cache.store(entry, out)
