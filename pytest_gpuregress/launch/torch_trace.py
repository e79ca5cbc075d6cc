"""torch's own flight recorder on NCCL/RCCL ranks: dumped on a hang, collected and read for the report.

Dumps come on the launcher's request at its limit (``request_dumps``/``serve_requests``) or from the
watchdog on a timeout set below the limit (``group_timeout``, ``arm``); ``diagnose`` then names the culprit
as torch's ``fr_trace`` does. Why two sources, and the variables set: docs/launching.md. A rank that dumped
is never reused, since torch fixes the dump's file name at a process's first dump.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..reference import atomic
from . import safe_pickle
from .flight import TORCH_TRACE_ENTRIES, queues_work

# Seconds between the NCCL watchdog's timeout and the launcher's kill: torch waits up to
# TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default) for the dump, and its peers learn of the timeout
# through the store within TORCH_NCCL_COORD_CHECK_MILSEC (1 s) before they dump too.
DUMP_MARGIN_S = 30.0
# gloo's group timeout lies past the wall-clock limit: the launcher reports hung ranks with their stacks.
GLOO_MARGIN_S = 60.0
PREFIX = "torch_fr_trace_rank"  # torch appends the global rank: torch_fr_trace_rank0
FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch reads the first one set
DUMP_VAR = "TORCH_NCCL_DUMP_ON_TIMEOUT"
# Start events per collective, without which no entry is ever "started" (ProcessGroupNCCL records them only
# with it): the "queued but never started" culprit needs it. It adds two CUDA events per collective.
TIMING_VAR = "TORCH_NCCL_ENABLE_TIMING"
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # entries in the ring; the first one set
# The prefix this plugin set last in this process: a later job (in place, one process serves every launch)
# moves it to its own folder, while a prefix the user set is left alone.
ARMED_VAR = "GPUREGRESS_TORCH_TRACE_PREFIX"
COMPLETED = "completed"
REQUEST = "torch_fr_dump_request"  # in the run folder: the launcher asks the ranks for their dumps (spawn.py)
REQUEST_POLL_S = 0.2  # how often a rank looks for the request, and the launcher for the dumps
REQUEST_WAIT_S = 10.0  # how long the launcher waits for the ranks' dumps before it kills them
_DTENSOR_API = "/torch/distributed/tensor/_api.py"  # full_tensor() calls redistribute(): name full_tensor
# Frames of the collective machinery between the code that asked for a collective and ProcessGroupNCCL.
_PLUMBING = (
    "/torch/distributed/distributed_c10d.py", "/torch/distributed/c10d_logger.py",
    "/torch/distributed/_functional_collectives", "/torch/_ops.py", "/torch/autograd/function.py",
    "/torch/distributed/tensor/_redistribute.py", "/torch/distributed/tensor/_collective_utils.py",
    "/torch/distributed/tensor/_dispatch.py", "/torch/distributed/tensor/placement_types.py",
    "/torch/distributed/tensor/_ops/", "/torch/_library/", "/torch/utils/_contextlib.py", "/torch/_compile.py",
    "/torch/_dynamo/", "/pytest_gpuregress/launch/flight.py", "/pytest_gpuregress/faults/",
)


def group_timeout(backend: str, wall_s: float) -> float:
    """The process group's timeout for a launch killed after ``wall_s`` s. NCCL/RCCL: below it (at least half), so an
    early hang times out and dumps before the kill (later ones get the dump ``request_dumps`` asks for); gloo: past
    it, so the launcher's own report names the hung ranks."""
    if queues_work(backend):
        return max(wall_s - DUMP_MARGIN_S, wall_s / 2)
    return wall_s + GLOO_MARGIN_S


def arm(run_dir: Path, backend: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make torch dump its recorder into ``run_dir`` on a watchdog timeout; the dump's file prefix, or None on gloo.
    Values the user set stay; ``environ`` (this process's by default) is read by torch when the group is created and
    when it dumps. Idempotent for the same folder."""
    env = os.environ if environ is None else environ
    if not queues_work(backend):
        return None
    env.setdefault(DUMP_VAR, "1")
    env.setdefault(TIMING_VAR, "1")
    if not env.get(BUFFER_VARS[0]):  # older torch keeps no ring by default (0 entries): nothing to dump
        env.setdefault(BUFFER_VARS[1], str(TORCH_TRACE_ENTRIES))
    ours = env.get(ARMED_VAR)
    if not any(env.get(name) for name in FILE_VARS) or (ours and env.get(FILE_VARS[0]) == ours):
        prefix = str(run_dir / PREFIX)
        for name in FILE_VARS:  # both names: an older torch reads only the second
            env[name] = prefix
        env[ARMED_VAR] = prefix
    return dump_prefix(env)


def dump_prefix(environ: Mapping[str, str]) -> str | None:
    """The file prefix torch writes its dump under, as torch picks it (the first of FILE_VARS that is set)."""
    return next((environ[name] for name in FILE_VARS if environ.get(name)), None)


def collect(prefix: str, ranks: range, run_dir: Path, since: float) -> dict[int, Path]:
    """The dump of each rank that wrote one at or after ``since`` (epoch seconds), copied into ``run_dir`` when the
    user sent it elsewhere, so the kept run folder carries it."""
    found: dict[int, Path] = {}
    for rank in ranks:
        path = Path(f"{prefix}{rank}")
        if not _fresh(path, since):
            continue
        kept = run_dir / f"{PREFIX}{rank}"
        if path.resolve() != kept.resolve():
            try:
                shutil.copyfile(path, kept)
            except OSError:
                kept = path
        found[rank] = kept
    return found


def _fresh(path: Path, since: float) -> bool:
    """Whether ``path`` was written at or after ``since``: a user's fixed location may hold a dump of an earlier
    run (a second of slack: coarse file times)."""
    try:
        return path.stat().st_mtime >= since - 1.0
    except OSError:
        return False


def dump_json(backend: str = "nccl", c10d: Any = None) -> bytes:
    """This process's flight recorder for ``backend`` as JSON, every entry (the completed ones give each rank's
    sequence). ``c10d``: torch's ``torch._C._distributed_c10d``, or a stand-in."""
    if c10d is None:
        from torch._C import _distributed_c10d as c10d
    # torch keeps two recorders: the CPU one, which gloo and the functional collectives' host side record into, and
    # NCCL's own, which ProcessGroupNCCL (RCCL too) records every collective into. On NCCL the CPU one holds none of
    # them, so a hang's dump comes from NCCL's; where a build lacks it, the CPU one is the fallback.
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if queues_work(backend) else ("_dump_fr_trace_json",)
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is not None:
            data = dump(True, False)  # includeCollectives, onlyActive
            return data.encode() if isinstance(data, str) else bytes(data)
    raise RuntimeError(f"this torch has none of {', '.join(names)}")


class DumpResponder:
    """A daemon thread that writes this rank's dump to ``path`` once the launcher asks (``REQUEST`` in
    ``run_dir``). It sleeps between looks (``time.sleep`` lets go of the GIL), so a rank blocked in a collective
    still answers; ``close`` stops it at the end of the job (ranks serve one job after another)."""

    def __init__(self, run_dir: Path, path: Path, *, poll_s: float = REQUEST_POLL_S,
                 dump: Callable[[], bytes] = dump_json) -> None:
        self.request = run_dir / REQUEST
        self.path = path
        self.poll_s = poll_s
        self._dump = dump
        self._stop = False
        self._thread = threading.Thread(target=self._watch, name="gpuregress-torch-fr", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop:
            if self.request.exists():
                self.answer()
                return
            time.sleep(self.poll_s)

    def answer(self) -> bool:
        """Write the dump (a temporary file renamed over the target: the launcher never reads half of one)."""
        try:
            atomic.write_bytes(self.path, self._dump())
        except Exception as exc:  # noqa: BLE001 - no dump is no paragraph in the report; the rank goes on
            print(f"gpuregress: could not dump torch's flight recorder to {self.path}: {exc!r}", file=sys.stderr)
            return False
        return True

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=self.poll_s + 5)


def serve_requests(run_dir: Path, rank: int, backend: str, cleanup_hooks: list[Callable[[], None]],
                   environ: Mapping[str, str] | None = None) -> DumpResponder | None:
    """On NCCL/RCCL, answer the launcher's request for this job's dump until the cleanup hooks run; the dump goes
    where torch's own would (``dump_prefix`` + the global rank), which ``report`` reads. None on gloo, or with no
    location (``arm`` comes first)."""
    prefix = dump_prefix(os.environ if environ is None else environ)
    if not queues_work(backend) or not prefix:
        return None
    responder = DumpResponder(run_dir, Path(f"{prefix}{rank}"), dump=lambda: dump_json(backend))
    cleanup_hooks.append(responder.close)
    return responder


def request_dumps(run_dir: Path, prefix: str, live: Callable[[], list[int]]) -> list[int]:
    """Ask the ranks of a hung launch for their dumps, and wait up to REQUEST_WAIT_S for each rank still in
    ``live()`` to write one; the live ranks that did not."""
    asked = time.time()
    atomic.write_bytes(run_dir / REQUEST, f"{asked}\n".encode())
    end = time.monotonic() + REQUEST_WAIT_S
    while True:
        missing = [r for r in live() if not _fresh(Path(f"{prefix}{r}"), asked)]
        if not missing or time.monotonic() >= end:
            return missing
        time.sleep(REQUEST_POLL_S)


def read_dump(path: Path) -> dict[str, Any]:
    """One rank's dump as plain data: a pickle from torch's watchdog, JSON from a rank the launcher asked (the same
    schema). Raises ``safe_pickle.UnreadablePickle`` (``UnsafePickle`` for a file that names any Python code:
    nothing in it runs)."""
    data = path.read_bytes()
    if data.lstrip()[:1] == b"{":
        dump = json.loads(data)
    else:
        dump = safe_pickle.loads(data, f"the flight-recorder dump {path}")
    if not isinstance(dump, dict):
        raise safe_pickle.UnreadablePickle(f"cannot read {path}: a flight-recorder dump is a dict, this is "
                                           f"{type(dump).__name__}")
    return dump


@dataclass(frozen=True)
class Entry:
    """One collective of one rank, from its dump."""

    rank: int
    group: str  # the process group's name, the same on every member
    desc: str  # its description: default_pg, a mesh dimension
    seq: int  # collective_seq_id: the n-th collective of this group on this rank
    op: str  # profiling_name: nccl:all_reduce, nccl:_reduce_scatter_base
    state: Literal["scheduled", "started", "completed"]
    sizes: str
    created_ns: int
    origin: str  # the frame that asked for it, past the collective machinery

    @property
    def label(self) -> str:
        sizes = f", {self.sizes}" if self.sizes else ""
        origin = f", from {self.origin}" if self.origin else ""
        return f"{self.op} #{self.seq} (group {self.desc or self.group}{sizes}{origin})"


def entries_of(rank: int, dump: Mapping[str, Any]) -> list[Entry]:
    """The collectives (not point-to-point calls) in a rank's dump."""
    return [_entry(rank, raw) for raw in dump.get("entries") or [] if isinstance(raw, dict) and not raw.get("is_p2p")]


def _entry(rank: int, raw: Mapping[str, Any]) -> Entry:
    group = raw.get("process_group") or ("", "")
    return Entry(rank=rank, group=str(group[0]), desc=str(group[1]) if len(group) > 1 else "",
                 seq=int(raw.get("collective_seq_id") or 0), op=str(raw.get("profiling_name") or "?"),
                 state=str(raw.get("state") or ""), sizes=_sizes(raw), created_ns=int(raw.get("time_created_ns") or 0),
                 origin=_origin(raw.get("frames") or []))


def members(dumps: Mapping[int, Mapping[str, Any]], group: str, desc: str = "") -> set[int]:
    """The global ranks of ``group`` as the dumps' pg_config lists them ("[0, 1]"); found by the group's description
    where the config names it otherwise (gloo's default group is "" there, "0" in its entries)."""
    ranks: set[int] = set()
    for dump in dumps.values():
        config = _config_of(dump.get("pg_config") or {}, group, desc)
        try:
            ranks.update(int(r) for r in json.loads(str(config.get("ranks", "[]"))))
        except (ValueError, TypeError):
            continue
    return ranks


def _config_of(configs: Mapping[str, Any], group: str, desc: str) -> Mapping[str, Any]:
    """``group``'s entry in a dump's pg_config: by its name, else by its description, else the only one there."""
    return configs.get(group) or next((c for c in configs.values() if desc and c.get("desc") == desc), None) \
        or (next(iter(configs.values())) if len(configs) == 1 else {})


def diagnose(dumps: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The culprit in torch's dumps: which rank the others wait for, in which collective; None when every
    collective completed. The group whose oldest unfinished collective started first is the one judged."""
    by_group: dict[str, dict[int, list[Entry]]] = {}
    for rank, dump in dumps.items():
        for entry in entries_of(rank, dump):
            by_group.setdefault(entry.group, {}).setdefault(rank, []).append(entry)
    since = {group: _unfinished_since(ranks) for group, ranks in by_group.items()}
    stuck = sorted((created, group) for group, created in since.items() if created is not None)
    if not stuck:
        return None
    group = stuck[0][1]
    desc = next(e.desc for entries in by_group[group].values() for e in entries)
    line = _judge(by_group[group], members(dumps, group, desc), set(dumps))
    if len(stuck) > 1:
        line += f"; {len(stuck) - 1} other process group(s) have unfinished collectives too"
    return line


def _unfinished_since(ranks: dict[int, list[Entry]]) -> int | None:
    """When a group's oldest unfinished collective was created (ns); None when every one completed."""
    return min((e.created_ns for entries in ranks.values() for e in entries if e.state != COMPLETED), default=None)


def _judge(ranks: dict[int, list[Entry]], expected: set[int], dumped: set[int]) -> str:
    """The culprit line for one stuck group, in torch's order of cases (its error_analysis): a member that never
    entered the collective, members that disagree on what it is, then how far each member got in it."""
    expected = expected or set(ranks)
    last = {r: max((e.seq for e in ranks.get(r, [])), default=0) for r in expected & dumped}
    oldest = _oldest_unfinished(ranks)
    waiting_seq = min(e.seq for e in oldest.values())
    missing = sorted(expected - dumped)
    tail = f"; no dump from {_ranks(missing)} (killed before it wrote one)" if missing else ""
    behind = sorted(r for r, seq in last.items() if seq < waiting_seq)
    if behind:
        return _never_entered(ranks, oldest, waiting_seq, behind) + tail
    present = _entries_at(ranks, sorted(last), oldest, waiting_seq)
    return (_diverged(present, waiting_seq) or _how_far(present, bool(missing))) + tail


def _oldest_unfinished(ranks: dict[int, list[Entry]]) -> dict[int, Entry]:
    """Each rank's oldest collective it did not complete, for the ranks that have one."""
    unfinished = {r: [e for e in entries if e.state != COMPLETED] for r, entries in ranks.items()}
    return {r: min(entries, key=lambda e: e.seq) for r, entries in unfinished.items() if entries}


def _entries_at(ranks: dict[int, list[Entry]], members: list[int], oldest: dict[int, Entry],
                seq: int) -> dict[int, Entry]:
    """Each member's entry of collective number ``seq``, where its dump holds one; else each rank's oldest
    unfinished collective, where it is that one."""
    found = {r: e for r in members for e in ranks.get(r, []) if e.seq == seq}
    return found or {r: e for r, e in sorted(oldest.items()) if e.seq == seq}


def _never_entered(ranks: dict[int, list[Entry]], oldest: dict[int, Entry], waiting_seq: int,
                   behind: list[int]) -> str:
    """Not every member entered the collective (torch's "Not all ranks joining"): who waits, for whom."""
    waiters = sorted(r for r, e in oldest.items() if e.seq == waiting_seq)
    parts = []
    for r in behind:
        prior = max(ranks.get(r, []), key=lambda e: e.seq, default=None)
        before = f"its last: {prior.op} #{prior.seq}, {prior.state}" if prior else "no collective of this group"
        parts.append(f"rank {r} never entered it ({before})")
    verb = "waits" if len(waiters) == 1 else "wait"
    return f"{_ranks(waiters)} {verb} in {oldest[waiters[0]].label} for {_ranks(behind)}: {'; '.join(parts)}"


def _diverged(present: dict[int, Entry], waiting_seq: int) -> str:
    """The members disagree on what the collective is (another op, other sizes); "" when they agree."""
    if len({(e.op, e.sizes) for e in present.values()}) <= 1:
        return ""
    what = ", ".join(f"rank {r} {e.op} ({e.sizes or 'no sizes'})" for r, e in present.items())
    return f"the ranks' call sequences diverged at collective #{waiting_seq}: {what}"


def _how_far(present: dict[int, Entry], some_missing: bool) -> str:
    """Every member entered the same collective: which finished it, which run it, which only queued it."""
    entry = next(iter(present.values()))
    done = sorted(r for r, e in present.items() if e.state == COMPLETED)
    started = sorted(r for r, e in present.items() if e.state == "started")
    queued = sorted(set(present) - set(done) - set(started))  # scheduled: on the stream, not yet run
    if done:
        return f"{_ranks(started + queued)} did not finish {entry.label}, which {_ranks(done)} finished"
    if started and queued:
        return (f"{_ranks(started)} run {entry.label} on the GPU; {_ranks(queued)} queued it but never started "
                "it (earlier work on its GPU did not finish)")
    if some_missing:  # the ranks that dumped agree: the one that did not is the suspect
        verb = "waits" if len(present) == 1 else "wait"
        return f"{_ranks(sorted(present))} {verb} in {entry.label}"
    return (f"every rank is in {entry.label}: the transport itself is stuck (network, NCCL/RCCL, driver) "
            "or a GPU stopped in it")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _sizes(raw: Mapping[str, Any]) -> str:
    sizes = raw.get("input_sizes") or []
    dtypes = raw.get("input_dtypes") or []
    shapes = "+".join("x".join(map(str, s)) or "scalar" for s in sizes if isinstance(s, list))
    return f"{shapes} {'/'.join(sorted(set(map(str, dtypes))))}".strip()


def _origin(frames: list[Any]) -> str:
    """The innermost frame outside the collective machinery: DTensor's ``full_tensor``, ``clip_grad_norm_``, a
    scenario's step. Frames come innermost first."""
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        filename = str(frame.get("filename", ""))
        if any(part in filename for part in _PLUMBING) or (filename.endswith(_DTENSOR_API) and frame.get("name") == "redistribute"):
            continue
        short = filename.split("site-packages/")[-1]
        short = "/".join(short.split("/")[-3:])
        return f"{frame.get('name', '?')} ({short}:{frame.get('line', '?')})"
    return ""


def report(prefix: str | None, world_size: int, run_dir: Path, since: float) -> str | None:
    """The report's paragraph on torch's dumps of a failed launch: the culprit line and the files; None without
    dumps. An unreadable or refused dump is named with the reason, never loaded."""
    if not prefix:
        return None
    paths = collect(prefix, range(world_size), run_dir, since)
    if not paths:
        return None
    dumps: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    for rank, path in paths.items():
        try:
            dumps[rank] = read_dump(path)
        except (OSError, ValueError) as exc:
            problems.append(f"rank {rank}: {exc}")
    lines = ["torch's flight recorder (the ranks' dumps): "
             + (diagnose(dumps) or "every recorded collective completed") if dumps else
             "torch's flight recorder: no readable dump"]
    lines.extend(problems)
    lines.append("dumps: " + ", ".join(str(paths[r]) for r in sorted(paths)))
    return "\n".join(lines)
