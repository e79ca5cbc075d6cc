"""A flight recorder of collectives, after NCCL's: which collective each rank is in, so a hang names its culprit.

A hung group shows every rank "hung", but usually one rank stopped and the others wait for it in
a collective. Each rank counts the collectives it enters (op, sequence number, bytes) and keeps
its current state in a small memory-mapped file, ``rank<r>.flight``: a plain memory write per
call, readable by the launcher while the rank is blocked in C++ (a Python signal handler would
never run there). ``diagnose`` turns every rank's state into one line:

    rank 0 waits in all_gather #57 (64 KiB) for rank 1; rank 1 stopped outside any collective
    (last: all_gather #56), after step 2 done
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..faults.collective import COLLECTIVES, nbytes
from ..units import human_bytes

SLOT = 128  # bytes of the state line; padded with spaces
_WRAPPED = (*COLLECTIVES, "barrier", "monitored_barrier")


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


class FlightRecorder:
    """This rank's state file, and wrappers around ``torch.distributed``'s collectives that keep it."""

    def __init__(self, path: Path) -> None:
        path.write_bytes(b" " * SLOT)
        self._file = open(path, "r+b")  # noqa: SIM115 - mapped for the rank's lifetime in this job
        self._map = mmap.mmap(self._file.fileno(), SLOT)
        self.seq = 0

    def _write(self, state: str, op: str, size: int) -> None:
        line = f"{state} {op} {self.seq} {size}".encode()[:SLOT]
        self._map[:SLOT] = line.ljust(SLOT)

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        family = COLLECTIVES.get(name, (name, ""))[0]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.seq += 1
            self._write("in", family, max(nbytes(args[0]) if args else 0, nbytes(args[1]) if len(args) > 1 else 0))
            result = original(*args, **kwargs)
            self._write("out", family, 0)
            return result

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    def close(self) -> None:
        self._map.close()
        self._file.close()


def install(path: Path, cleanup_hooks: list[Callable[[], None]]) -> FlightRecorder:
    """Record every collective of this rank into ``path`` until the cleanup hooks run."""
    import torch.distributed as dist

    recorder = FlightRecorder(path)
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
    furthest = max(s.seq for s in waiting.values())
    # A rank is waited for when it is outside any collective, or has entered fewer than the waiters.
    behind = sorted(r for r, s in states.items() if s is None or not s.inside or s.seq < furthest)
    parts = []
    for rank in sorted(waiting):
        if rank not in behind:
            culprits = ", ".join(map(str, behind)) if behind else "no rank outside it"
            parts.append(f"rank {rank} waits in {waiting[rank].label} for rank {culprits}")
    for rank in behind:
        state = states[rank]
        where = progress.get(rank) or "no progress"
        if state is None:
            parts.append(f"rank {rank} never entered a collective ({where})")
        elif state.inside:
            parts.append(f"rank {rank} is in an earlier collective, {state.label} ({where})")
        else:
            parts.append(f"rank {rank} stopped outside any collective (last: {state.label}), after {where}")
    if not behind:
        ops = {s.label for s in waiting.values()}
        what = "the same collective: the transport itself is stuck (network, NCCL/RCCL, driver)" if len(ops) == 1 \
            else "different collectives: the ranks' call sequences diverged"
        parts.append(f"every rank waits in {what}")
    return "; ".join(parts)
