"""A flight recorder of collectives, after NCCL's: which collective each rank is in, so a hang names its culprit.

Each rank keeps its current collective (op, sequence number, bytes) in a memory-mapped ``rank<r>.flight``,
readable while the rank is blocked in C++. On NCCL/RCCL a call returns once queued, so completion is read
from the caller's ``Work`` or a CUDA event recorded after the call. DTensor's functional collectives bypass
this wrapper: torch's own recorder covers them (torch_trace.py, docs/launching.md).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..faults.collective import COLLECTIVES, nbytes
from ..units import human_bytes

SLOT = 128  # bytes of the state line; padded with spaces
_WRAPPED = (*COLLECTIVES, "barrier", "monitored_barrier")
# Backends whose collectives return once queued on the device stream (torch names RCCL "nccl" too).
_QUEUED_BACKENDS = ("nccl", "rccl")
POLL_S = 0.05  # how often queued collectives are checked for completion
TORCH_TRACE_ENTRIES = 2000  # torch's NCCL flight recorder ring: enough for a few steps of a sharded model


def queues_work(backend: str | None) -> bool:
    """True when ``backend``'s collectives return before the device has run them ("cpu:gloo,cuda:nccl" too)."""
    return any(name in (backend or "").lower() for name in _QUEUED_BACKENDS)


@dataclass(frozen=True)
class FlightState:
    """A rank's last collective: ``inside`` while it has entered and not yet returned."""

    rank: int
    inside: bool
    op: str
    seq: int
    size: int

    @property
    def label(self) -> str:
        return f"{self.op} #{self.seq}" + (f" ({human_bytes(self.size)})" if self.size else "")


@dataclass
class _Queued:
    """A collective handed to a queueing backend; ``done`` answers whether the GPU finished it (None while the
    call is still enqueuing it)."""

    seq: int
    op: str
    size: int
    done: Callable[[], bool] | None = None

    def finished(self) -> bool:
        if self.done is None:
            return False
        try:
            return bool(self.done())
        except Exception:  # noqa: BLE001 - a failed work no longer runs on the device; the rank raises on it
            return True


class FlightRecorder:
    """This rank's state file, and wrappers around ``torch.distributed``'s collectives that keep it. ``queued``: the
    backend returns before the device ran a collective (NCCL, RCCL), so a thread reads completion every ``poll_s``
    (None: only when ``refresh`` is called)."""

    def __init__(self, path: Path, *, queued: bool = False, poll_s: float | None = POLL_S,
                 stream_marker: Callable[[], Callable[[], bool] | None] | None = None) -> None:
        path.write_bytes(b" " * SLOT)
        self._file = open(path, "r+b")  # noqa: SIM115 - mapped for the rank's lifetime in this job
        self._map = mmap.mmap(self._file.fileno(), SLOT)
        self.seq = 0
        self.queued = queued
        # After a plain call: what says the current stream has passed it (a CUDA event's query), or None.
        self._mark_stream = stream_marker or _cuda_stream_marker
        self._last_op = ""
        self._pending: list[_Queued] = []
        self._lock = threading.Lock()  # the caller's thread and the poller both write the state
        self._closed = False
        self._device: int | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if queued and poll_s:
            self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="gpuregress-flight", daemon=True)
            self._poller.start()

    def _write(self, state: str, op: str, seq: int, size: int) -> None:
        line = f"{state} {op} {seq} {size}".encode()[:SLOT]
        self._map[:SLOT] = line.ljust(SLOT)

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        family = COLLECTIVES.get(name, (name, ""))[0]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if _compiling():
                return original(*args, **kwargs)
            size = max(nbytes(args[0]) if args else 0, nbytes(args[1]) if len(args) > 1 else 0)
            if self.queued:
                return self._call_queued(family, size, original, args, kwargs)
            with self._lock:
                self.seq += 1
                self._last_op = family
                self._write("in", family, self.seq, size)
            result = original(*args, **kwargs)
            with self._lock:
                self._write("out", family, self.seq, 0)
            return result

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    def _call_queued(self, family: str, size: int, original: Callable[..., Any],
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Make the call as the caller made it, then keep what says when the GPU has finished it."""
        if self._device is None:  # the poller binds to it to query CUDA events: no context on GPU 0
            self._device = _current_cuda_device()
        entry = self._enter(family, size)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            self._queued(entry, None)
            raise
        # The caller's own Work when it asked for async_op; else an event on the stream the plain call left waiting.
        self._queued(entry, result.is_completed if hasattr(result, "is_completed") else self._mark_stream())
        return result

    def _enter(self, family: str, size: int) -> _Queued:
        with self._lock:
            self.seq += 1
            self._last_op = family
            entry = _Queued(self.seq, family, size)
            self._pending.append(entry)
            self._show()
        return entry

    def _queued(self, entry: _Queued, done: Callable[[], bool] | None) -> None:
        with self._lock:
            entry.done = done
            if done is None:  # the call raised, or nothing tells completion (no CUDA): done when it returned
                self._pending.remove(entry)
            self._show()

    def refresh(self) -> None:
        """Drop the collectives the device has finished and show the oldest one it has not."""
        with self._lock:
            self._pending = [q for q in self._pending if not q.finished()]
            self._show()

    def _show(self) -> None:
        if self._closed:
            return
        if self._pending:
            oldest = self._pending[0]
            self._write("in", oldest.op, oldest.seq, oldest.size)
        else:
            self._write("out", self._last_op, self.seq, 0)

    def _poll(self, interval: float) -> None:
        bound = False
        while not self._stop.wait(interval):
            if not bound and self._device is not None:
                bound = _bind_cuda_device(self._device)
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5 * POLL_S + 1)
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._map.close()
            self._file.close()


def _compiling() -> bool:
    import torch  # imported already: these wrappers replace torch.distributed's functions

    return bool(torch.compiler.is_compiling())


def _cuda_stream_marker() -> Callable[[], bool] | None:
    """A CUDA event recorded on the current stream, as its query; None without an initialised CUDA."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        event = torch.cuda.Event()
        event.record()
        return event.query
    except Exception:  # noqa: BLE001 - without a usable CUDA the call's return is all there is to go by
        return None


def _current_cuda_device() -> int | None:
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - without a usable CUDA there is nothing to bind
        return None


def _bind_cuda_device(device: int) -> bool:
    try:
        import torch

        torch.cuda.set_device(device)
        return True
    except Exception:  # noqa: BLE001 - polling still works, at worst with a context on the default device
        return False


def install(path: Path, cleanup_hooks: list[Callable[[], None]], backend: str | None = None) -> FlightRecorder:
    """Record every collective of this rank into ``path`` until the cleanup hooks run."""
    import torch.distributed as dist

    recorder = FlightRecorder(path, queued=queues_work(backend))
    if recorder.queued:
        # torch's own NCCL flight recorder sees what these wrappers cannot (DTensor's functional collectives). It is
        # read when the process group is created, which comes after this; a value the user set stays.
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(TORCH_TRACE_ENTRIES))
    for name in _WRAPPED:
        original = getattr(dist, name, None)
        if original is None:
            continue
        setattr(dist, name, recorder.wrap(name, original))
        cleanup_hooks.append(lambda name=name, original=original: setattr(dist, name, original))
    cleanup_hooks.append(recorder.close)
    return recorder


def read(path: Path, rank: int) -> FlightState | None:
    try:
        fields = path.read_bytes()[:SLOT].decode(errors="replace").split()
    except OSError:
        return None
    if len(fields) != 4 or fields[0] not in ("in", "out"):
        return None  # no collective yet
    return FlightState(rank, fields[0] == "in", fields[1], int(fields[2]), int(fields[3]))


def diagnose(states: dict[int, FlightState | None], progress: dict[int, str | None]) -> str | None:
    """Which ranks wait, in which collective, and for whom; None when no rank is waiting in one."""
    waiting = {r: s for r, s in states.items() if s is not None and s.inside}
    if not waiting:
        return None
    behind = _waited_for(states, waiting)
    if not behind:  # no one to name: the closing clause says what all of them wait in
        return "; ".join([*(f"rank {r} waits in {waiting[r].label}" for r in sorted(waiting)), _all_waiting(waiting)])
    culprits = ", ".join(map(str, behind))
    parts = [f"rank {r} waits in {waiting[r].label} for rank {culprits}" for r in sorted(waiting) if r not in behind]
    return "; ".join(parts + [_behind(r, states[r], progress.get(r)) for r in behind])


def _waited_for(states: dict[int, FlightState | None], waiting: dict[int, FlightState]) -> list[int]:
    """The ranks outside any collective, or in an earlier one than the furthest waiter."""
    furthest = max(s.seq for s in waiting.values())
    return sorted(r for r in states if r not in waiting or waiting[r].seq < furthest)


def _behind(rank: int, state: FlightState | None, progress: str | None) -> str:
    """Where a rank the others wait for is instead, and its last progress."""
    where = progress or "no progress"
    if state is None:
        return f"rank {rank} never entered a collective ({where})"
    if state.inside:
        return f"rank {rank} is in an earlier collective, {state.label} ({where})"
    return f"rank {rank} stopped outside any collective (last: {state.label}), after {where}"


def _all_waiting(waiting: dict[int, FlightState]) -> str:
    """Every rank waits in a collective: in the same one, the transport is stuck; in different ones, the ranks'
    call sequences diverged."""
    if len({s.label for s in waiting.values()}) == 1:
        return "every rank waits in the same collective: the transport itself is stuck (network, NCCL/RCCL, driver)"
    return "every rank waits in different collectives: the ranks' call sequences diverged"
