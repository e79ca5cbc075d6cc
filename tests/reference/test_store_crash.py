"""The store survives a recording killed at any instant, and cleans up what interrupted writes leave.

In the crash test a child Python process records references in a loop (``write_forever``); the
parent SIGKILLs it after a random delay and checks that the reference still loads, verified, and
is the last one written or the one in flight. Leftovers of each kind get a unit test of their own.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.errors import ReferenceExists
from pytest_gpuregress.reference import atomic, store
from pytest_gpuregress.reference.record import RunRecord

KILLS = 20
BIG_ELEMENTS = 1 << 20  # float32: a 4 MiB tensor, so a write takes long enough to be cut at any point


def big_record(generation: int, elements: int = BIG_ELEMENTS) -> RunRecord:
    """A record whose content is fixed by ``generation``: what was written can be rebuilt and compared."""
    rng = np.random.default_rng(generation)
    return RunRecord(
        scenario="fsdp",
        config={"generation": generation, "steps": 3},
        platform_key="cpu-gloo-w2-fp32",
        world_size=2,
        series={"loss": [float(x) for x in rng.normal(size=3)]},
        arrays={"weights": rng.standard_normal(elements, dtype=np.float32), "small": np.arange(generation % 7 + 1)},
    )


def location(root: Path) -> store.ReferenceLocation:
    return store.ReferenceLocation(root, "fsdp", "cpu-gloo-w2-fp32")


def assert_is_generation(loaded: RunRecord, generation: int, elements: int = BIG_ELEMENTS) -> None:
    expected = big_record(generation, elements)
    assert loaded.config == expected.config and loaded.series == expected.series
    assert loaded.arrays.keys() == expected.arrays.keys()
    for key, value in expected.arrays.items():
        np.testing.assert_array_equal(loaded.arrays[key], value)


def write_forever(root: Path, first_generation: int, fallback: bool) -> None:
    """The child: record generation after generation, printing each one once it is stored."""
    if fallback:  # as on a filesystem without RENAME_EXCHANGE
        atomic.exchange = lambda a, b: False
    loc = location(root)
    print("ready", flush=True)
    generation = first_generation
    while True:
        store.write_reference(loc, big_record(generation), overwrite=True)
        print(generation, flush=True)
        generation += 1


CHILD_PRELUDE = f"""
import sys
from pathlib import Path
import numpy as np
from pytest_gpuregress.reference import atomic, store
from pytest_gpuregress.reference.record import RunRecord
BIG_ELEMENTS = {BIG_ELEMENTS}
"""


def child_source() -> str:
    """The child's program: this file's record builder and writer, without pytest (half a second to import)."""
    functions = [inspect.getsource(f) for f in (big_record, location, write_forever)]
    return "\n".join([CHILD_PRELUDE, *functions, "write_forever(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1')"])


def kill_one_recording(root: Path, first_generation: int, delay_s: float, fallback: bool) -> list[int]:
    """Start a recording child, SIGKILL it ``delay_s`` after it is ready; return the generations it finished."""
    child = subprocess.Popen([sys.executable, "-c", child_source(), str(root), str(first_generation), str(int(fallback))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
    finally:
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return [int(line) for line in out.split()]


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.parametrize(("fallback", "kills"), [(False, KILLS), (True, KILLS)], ids=["exchange", "fallback"])
def test_killed_recording_leaves_the_old_or_the_new_reference(tmp_path: Path, fallback: bool, kills: int) -> None:
    if not fallback and not _exchange_works(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here; the fallback case covers this machine")
    loc = location(tmp_path / "refs")
    store.write_reference(loc, big_record(0), overwrite=False)
    rng = random.Random(1234 + fallback)
    current = 0
    for attempt in range(kills):
        first = (attempt + 1) * 1000
        finished = kill_one_recording(loc.root, first, rng.uniform(0.0, 0.4), fallback)
        last_done = finished[-1] if finished else current
        in_flight = last_done + 1 if finished else first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's crash window puts the old one back
            loaded = store.read_reference(loc)  # checksums verified against the manifest
        generation = loaded.config["generation"]
        assert generation in (last_done, in_flight), (attempt, generation, last_done, in_flight)
        assert_is_generation(loaded, generation)
        current = generation
    # the next write cleans whatever the kills left behind
    store.write_reference(loc, big_record(1), overwrite=True)
    assert sorted(p.name for p in loc.path.parent.iterdir()) == [loc.platform_key]
    assert_is_generation(store.read_reference(loc), 1)


def _exchange_works(tmp_path: Path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return atomic.exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


# --- leftovers, one kind at a time -----------------------------------------------------------------

SMALL = 64  # elements: the unit tests need no big tensor
ID = "d" * 32  # the uuid4 hex an interrupted write leaves in its folder names


@pytest.fixture
def loc(tmp_path: Path) -> store.ReferenceLocation:
    loc = location(tmp_path / "refs")
    store.write_reference(loc, big_record(1, SMALL), overwrite=False)
    return loc


def aside(loc: store.ReferenceLocation, kind: str) -> Path:
    """A leftover folder of ``kind`` (atomic.NEW or atomic.OLD) holding a copy of the current reference."""
    folder = loc.path.with_name(f".{loc.platform_key}{kind}{ID}")
    folder.mkdir()
    for path in loc.path.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_exchange_swaps_two_folders(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from-a").touch()
    if not atomic.exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert [p.name for p in a.iterdir()] == [] and [p.name for p in b.iterdir()] == ["from-a"]


@pytest.mark.parametrize(("err", "supported"), [(errno.EINVAL, False), (errno.ENOSYS, False), (errno.ENOENT, True)])
def test_exchange_falls_back_only_when_the_kernel_or_filesystem_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      err: int, supported: bool) -> None:
    def failing_renameat2(old: bytes, new: bytes, flags: int) -> int:
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(atomic, "_renameat2", lambda: failing_renameat2)
    if supported:  # a real error of a working exchange is raised, not hidden behind the fallback
        with pytest.raises(FileNotFoundError):
            atomic.exchange(tmp_path / "a", tmp_path / "b")
    else:
        assert atomic.exchange(tmp_path / "a", tmp_path / "b") is False


def test_partial_staging_folder_is_ignored_by_readers_and_removed_by_the_next_write(loc: store.ReferenceLocation) -> None:
    staged = loc.path.with_name(f".{loc.platform_key}{atomic.NEW}{ID}")
    staged.mkdir()
    (staged / "record.json").write_text('{"trunc')  # a write killed half way
    assert_is_generation(store.read_reference(loc), 1, SMALL)
    assert atomic.leftovers(loc.path) == [staged]
    store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    assert not staged.exists()
    assert_is_generation(store.read_reference(loc), 2, SMALL)


def test_moved_aside_folder_beside_a_reference_is_removed_by_the_next_write(loc: store.ReferenceLocation) -> None:
    old = aside(loc, atomic.OLD)
    assert_is_generation(store.read_reference(loc), 1, SMALL)  # the reference in place wins; nothing restored
    assert old.exists()
    store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    assert not old.exists()


def test_temp_files_are_removed_by_the_next_write(loc: store.ReferenceLocation) -> None:
    beside = loc.path.parent / ".cpu-gloo-w2-fp32.0123.tmp"
    inside = loc.path / ".tensors.safetensors.4567.tmp"
    beside.write_bytes(b"half")
    inside.write_bytes(b"half")
    assert_is_generation(store.read_reference(loc), 1, SMALL)
    store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    assert not beside.exists() and not inside.exists()


def test_other_references_and_their_leftovers_are_left_alone(loc: store.ReferenceLocation) -> None:
    other = store.ReferenceLocation(loc.root, "fsdp", "cpu-gloo-w4-fp32")
    store.write_reference(other, big_record(3, SMALL), overwrite=False)
    others_leftover = other.path.with_name(f".{other.platform_key}{atomic.NEW}{ID}")
    others_leftover.mkdir()
    store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    assert others_leftover.exists()  # another reference's leftover: that reference's next write cleans it
    assert_is_generation(store.read_reference(other), 3, SMALL)


def test_reader_puts_back_a_reference_a_crash_left_moved_aside(loc: store.ReferenceLocation) -> None:
    # the old two-rename scheme, killed between its renames: no reference, the old one under .old-*
    old = loc.path.with_name(f".{loc.platform_key}{atomic.OLD}{ID}")
    os.rename(loc.path, old)
    with pytest.warns(RuntimeWarning, match="put back the reference .* moved aside"):
        loaded = store.read_reference(loc)
    assert_is_generation(loaded, 1, SMALL)
    assert loc.path.is_dir() and not old.exists()


def test_writer_without_the_flag_still_refuses_a_moved_aside_reference(loc: store.ReferenceLocation) -> None:
    old = loc.path.with_name(f".{loc.platform_key}{atomic.OLD}{ID}")
    os.rename(loc.path, old)
    with pytest.warns(RuntimeWarning), pytest.raises(ReferenceExists):
        store.write_reference(loc, big_record(2, SMALL), overwrite=False)
    assert_is_generation(store.read_reference(loc), 1, SMALL)  # put back, not lost


def test_fallback_swap_puts_the_old_reference_back_when_the_second_rename_fails(
        loc: store.ReferenceLocation, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def second_rename_fails(src: os.PathLike, dst: os.PathLike) -> None:
        renames.append((str(src), str(dst)))
        if len(renames) == 2:
            raise OSError(28, "No space left on device (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="simulated"):
        store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert len(renames) == 3  # aside, in (failed), back
    assert_is_generation(store.read_reference(loc), 1, SMALL)
    assert atomic.leftovers(loc.path) == []


def test_fallback_swap_replaces_and_leaves_nothing(loc: store.ReferenceLocation, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    store.write_reference(loc, big_record(2, SMALL), overwrite=True)
    assert_is_generation(store.read_reference(loc), 2, SMALL)
    assert sorted(p.name for p in loc.path.parent.iterdir()) == [loc.platform_key]
