"""Run a job on a group of ranks on this machine, watch them, and classify how each one ended.

A rank ends a job delivered (record and done marker written: a teardown crash after that is noted, never
a failure), raised, died, or hung (stacks dumped, and on NCCL/RCCL torch's flight recorder first).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import RankFailure
from ..reference.record import RECORD_JSON, RunRecord
from . import device_errors, flight, torch_trace
from .job import Job, RankFiles
from .pool import Rank, RankGroup, WorkerPool, rank_environment, shared_pool

POLL_S = 0.05
PROGRESS_EVERY_S = 1.0  # the launcher's side of "at most once a second"; the plugin may show fewer
# After the first rank fails, how long peers get to report their own error before being killed.
FAILURE_GRACE_S = 3.0
# After every rank has delivered, how long teardown may take before the stragglers are killed.
TEARDOWN_GRACE_S = 20.0
LOG_TAIL_LINES = 25


@dataclass
class RankOutcome:
    rank: int
    status: Literal["delivered", "raised", "died", "hung", "stopped"]
    returncode: int | None
    last_progress: str | None
    error: dict[str, str] | None = None
    stack: str | None = None
    log_tail: str = ""

    @property
    def signal_name(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None

    def describe(self) -> str:
        where = f"last progress: {self.last_progress or 'none (died before the scenario started)'}"
        if self.status == "raised" and self.error:  # an empty error file reads as a death, not a KeyError
            return f"rank {self.rank} raised {self.error['type']} ({where})\n{self.error['traceback']}"
        if self.status in ("hung", "stopped"):
            stack = _main_thread_stack(self.stack) or "(no stack dumped)"
            why = "still running at the time limit" if self.status == "hung" else "stopped after a peer failed"
            return f"rank {self.rank} {self.status}: {why} ({where})\n{stack}"
        how = self.signal_name or f"exit code {self.returncode}"
        return f"rank {self.rank} died with {how} before delivering results ({where})\n{self.log_tail}"


@dataclass
class LaunchResult:
    records: list[RunRecord]
    outcomes: list[RankOutcome]
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def scenario_label(entry: str) -> str:
    """'pytest_gpuregress.scenarios.fsdp.rank:run' as 'fsdp'; 'user_scenario:train' as 'user_scenario'."""
    parts = entry.split(":")[0].split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] == "rank" else parts[-1]


def describe_progress(line: str, job: Job) -> str:
    """'step 56 done, loss 3.2' as 'step 57 of 300, loss 3.2'; other phases as they are. A noise replica's
    lines say which replica they are, so a recording's progress does not read as the same run three times over."""
    from ..training.noise import PERTURBATIONS

    perturbation = job.config.get("perturbation")
    replica = f"replica {PERTURBATIONS.index(perturbation) + 1} ({perturbation}): " \
        if perturbation in PERTURBATIONS else ""
    match = re.fullmatch(r"step (\d+) done(.*)", line)
    steps = job.config.get("steps")
    if match is None or not steps:
        return replica + line
    return f"{replica}step {int(match.group(1)) + 1} of {steps}{match.group(2)}"


def time_left(line: str, job: Job, pace: dict[str, tuple[float, int]], now: float) -> str:
    """', about 1m20s left' at the pace since the first step the job reported ('' until a second step has)."""
    match = re.fullmatch(r"step (\d+) done.*", line)
    steps = job.config.get("steps")
    if match is None or not steps:
        return ""
    step = int(match.group(1))
    since, first = pace.setdefault(job.run_dir, (now, step))
    if step <= first:
        return ""
    seconds = (now - since) / (step - first) * max(int(steps) - 1 - step, 0)
    minutes, rest = divmod(int(round(seconds)), 60)
    return f", about {minutes}m{rest:02d}s left" if minutes else f", about {rest}s left"


def _main_thread_stack(dump: str | None) -> str | None:
    if not dump:
        return None
    blocks = dump.strip().split("\n\n")
    current = [b for b in blocks if "most recent call first" in b and b.startswith("Current thread")]
    return (current[0] if current else blocks[-1]).strip()


def sticky_ranks(run_dir: Path, world_size: int) -> dict[int, str]:
    """Ranks that reported a sticky CUDA/HIP error (device_errors.py), and which: in the error they raised, the
    record they delivered (a scenario may keep a device error as a finding), or the worker's own check after
    the job. A false alarm costs a fresh group of ranks; a miss, every later case of the session."""
    found: dict[int, str] = {}
    for rank in range(world_size):
        files = RankFiles(run_dir, rank)
        what = device_errors.first_sticky(_read(p) for p in (files.device_error, files.error, files.record_dir / RECORD_JSON))
        if what is None and files.device_error.exists():
            what = "device unusable after the job"  # the worker's synchronize failed with another error
        if what is not None:
            found[rank] = what
    return found


def _read(path: Path) -> str:
    """The file's text, "" where there is none."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])


class SpawnLauncher:
    """Runs a Job on ``world_size`` local ranks with a FileStore rendezvous, reusing ranks across jobs."""

    def __init__(self, keep_dirs: bool = False, base_dir: Path | None = None, reuse: bool = True,
                 pool: WorkerPool | None = None) -> None:
        """``reuse``: take ranks from ``pool``, by default the process's shared one (pool.py)."""
        self.keep_dirs = keep_dirs
        self.base_dir = base_dir
        self.pool = (pool or shared_pool()) if reuse else None
        self.owns_pool = pool is not None
        self.groups_started = 0
        self.on_progress: Callable[[str], None] | None = None  # rank 0's progress lines, while a job runs
        self._pace: dict[str, tuple[float, int]] = {}  # run dir -> (when, step) of the first step a job reported

    def make_run_dir(self) -> Path:
        if self.base_dir is not None:
            self.base_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="gpuregress-run-", dir=self.base_dir))

    def close(self) -> None:
        """Stop the pooled ranks of a pool of its own (the shared pool lives until the process exits)."""
        if self.pool is not None and self.owns_pool:
            self.pool.close()

    def _pooled(self, job: Job) -> bool:
        return self.pool is not None and not job.fresh_ranks

    def _group_for(self, job: Job) -> RankGroup:
        if self._pooled(job):
            before = self.pool.started
            group = self.pool.acquire(job)
            self.groups_started += self.pool.started - before
            return group
        self.groups_started += 1
        return RankGroup(job, self.base_dir)

    def run(self, job: Job, wall_timeout_s: float) -> LaunchResult:
        run_dir = Path(job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        job_path = run_dir / "job.json"
        job.cwd = job.cwd or os.getcwd()
        job.save(job_path)
        group = self._group_for(job)
        started, since = time.monotonic(), time.time()
        group.submit(job_path)
        outcomes: list[RankOutcome] = []
        try:
            outcomes, notes = self._watch(job, group, started + wall_timeout_s)
        finally:
            sticky = self._give_back(job, group, outcomes)
        wall = time.monotonic() - started
        retired = "; ".join(f"rank {r}: {what}" for r, what in sorted(sticky.items()))
        failed = [o for o in outcomes if o.status != "delivered"]
        if failed:
            message = self._failure_message(job, outcomes, failed, wall_timeout_s, since)
            if retired:
                message = f"{message}\n\nsticky device error ({retired}): these ranks were retired"
            raise RankFailure(message)
        if retired:
            notes.append(f"a rank reported a sticky device error ({retired}); its device context is unusable, so "
                         "its ranks were retired and the next launch gets fresh ones")
        records = [RunRecord.load(RankFiles(run_dir, r).record_dir) for r in range(job.world_size)]
        if not self.keep_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
        return LaunchResult(records=records, outcomes=outcomes, notes=notes, wall_s=wall)

    def _give_back(self, job: Job, group: RankGroup, outcomes: list[RankOutcome]) -> dict[int, str]:
        """Keep (or close) a group whose every rank delivered and released; kill any other, so the next job gets a
        fresh group. The ranks with a sticky device error, which would fail the next job with an error not its own."""
        run_dir = Path(job.run_dir)
        sticky = sticky_ranks(run_dir, job.world_size)
        clean = not sticky and len(outcomes) == job.world_size and all(
            o.status == "delivered" and RankFiles(run_dir, o.rank).released.exists() and o.returncode is None
            for o in outcomes
        )
        if not clean:  # a rank that failed, hung or did not release
            group.kill()
        elif self._pooled(job):
            self.pool.release(group)
        else:
            group.close()
        return sticky

    def _watch(self, job: Job, group: RankGroup, deadline: float) -> tuple[list[RankOutcome], list[str]]:
        """Wait for the ranks, then say what became of each: delivered, raised, hung, stopped or died."""
        files = [RankFiles(Path(job.run_dir), r) for r in range(job.world_size)]
        timed_out = self._wait(job, group.procs, files, deadline)
        # NCCL/RCCL at the limit: the ranks dump torch's flight recorder before the kill (its watchdog counts from
        # when a collective was queued, so it rarely comes first); None on gloo.
        prefix = torch_trace.arm(Path(job.run_dir), job.backend, rank_environment(job)) if timed_out else None
        if prefix:
            torch_trace.request_dumps(Path(job.run_dir), prefix, lambda: _working(group.procs, files))
        pending = _working(group.procs, files)
        for rank in pending:  # their Python stacks, before they are killed
            with suppress(ProcessLookupError):
                os.kill(group.procs[rank].pid, signal.SIGUSR1)
        if pending:
            time.sleep(1.0)
        notes: list[str] = []
        outcomes = [_outcome(rank, proc, f, group, timed_out, notes)
                    for rank, (proc, f) in enumerate(zip(group.procs, files))]
        return outcomes, notes

    def _wait(self, job: Job, procs: list[Rank], files: list[RankFiles], deadline: float) -> bool:
        """Until every rank is done (exited or released), a rank failed without delivering (after a grace), every
        rank delivered (after the teardown grace), or the deadline; True at the deadline. Shows progress."""
        began: dict[str, float] = {}  # when a rank first failed, when every rank had delivered
        shown, next_show = None, time.monotonic() + PROGRESS_EVERY_S
        while True:
            now = time.monotonic()
            if self.on_progress is not None and now >= next_show:
                line, next_show = files[0].last_progress(), now + PROGRESS_EVERY_S
                if line and line != shown:
                    left = time_left(line, job, self._pace, now)
                    self.on_progress(f"{scenario_label(job.scenario)}: {describe_progress(line, job)}{left}")
                shown = line
            if _settled(procs, files, began, now):
                return False
            if now > deadline:
                return True
            time.sleep(POLL_S)

    def _failure_message(
        self, job: Job, outcomes: list[RankOutcome], failed: list[RankOutcome], wall_timeout_s: float, since: float,
    ) -> str:
        run_dir = Path(job.run_dir)
        hung = any(o.status == "hung" for o in failed)
        head = f"scenario {job.scenario!r} on {job.world_size} {job.backend} ranks: " + ", ".join(
            f"rank {o.rank} {o.status}" for o in outcomes)
        if hung:
            head += f" (time limit {wall_timeout_s:.0f}s, --gpuregress-timeout)"
        # A hang: the collective each rank is in (our flight recorder), and whom the others wait for.
        waits = flight.diagnose({o.rank: flight.read(RankFiles(run_dir, o.rank).flight, o.rank) for o in outcomes},
                                {o.rank: o.last_progress for o in outcomes}) if hung else None
        # NCCL/RCCL: what torch's recorder saw (dumped on request or by its watchdog), DTensor's collectives included.
        dumps = torch_trace.report(torch_trace.arm(run_dir, job.backend, rank_environment(job)), job.world_size,
                                   run_dir, since)
        # The root cause first: a rank that raised or died, before peers that only noticed it.
        order = {"raised": 0, "died": 1, "hung": 2, "stopped": 3}
        body = "\n\n".join(o.describe() for o in sorted(failed, key=lambda o: (order[o.status], o.rank)))
        return "\n".join(filter(None, [head, waits, dumps, f"logs: {job.run_dir}"])) + f"\n\n{body}"


def _settled(procs: list[Rank], files: list[RankFiles], began: dict[str, float], now: float) -> bool:
    """Whether the ranks are done with the job: every one exited or released; or one failed without delivering,
    FAILURE_GRACE_S ago (its peers report their own errors meanwhile); or every one delivered, TEARDOWN_GRACE_S
    ago. ``began`` keeps when each grace began."""
    codes = [p.poll() for p in procs]
    delivered = [f.done.exists() for f in files]
    if all(c is not None or f.released.exists() for c, f in zip(codes, files)):
        return True
    failed = any(c not in (None, 0) and not d for c, d in zip(codes, delivered))
    return _past(began, "failure", failed, now, FAILURE_GRACE_S) or \
        _past(began, "teardown", all(delivered), now, TEARDOWN_GRACE_S)


def _past(began: dict[str, float], what: str, holds: bool, now: float, grace: float) -> bool:
    """Whether ``what`` holds now and first held more than ``grace`` seconds ago (``began`` keeps when)."""
    return holds and now - began.setdefault(what, now) > grace


def _working(procs: list[Rank], files: list[RankFiles]) -> list[int]:
    """The ranks still running that have not delivered."""
    return [r for r, (p, f) in enumerate(zip(procs, files)) if p.poll() is None and not f.done.exists()]


def _outcome(rank: int, proc: Rank, files: RankFiles, group: RankGroup, timed_out: bool,
             notes: list[str]) -> RankOutcome:
    """What became of one rank, from its files and exit code; a note where it misbehaved after delivering."""
    code = proc.poll()
    outcome = RankOutcome(rank=rank, status="", returncode=code, last_progress=files.last_progress())
    if files.done.exists():
        outcome.status = "delivered"
        notes.extend(filter(None, [_teardown_note(outcome, files)]))
    elif files.error.exists():
        outcome.status = "raised"
        outcome.error = json.loads(files.error.read_text())
    elif code is None:
        outcome.status = "hung" if timed_out else "stopped"
        outcome.stack = _read(files.stack) or None
    else:
        outcome.status = "died"
    outcome.log_tail = _tail(files.log) or _tail(group.startup_log(rank))
    return outcome



def _teardown_note(outcome: RankOutcome, files: RankFiles) -> str | None:
    """What a rank that delivered did wrong in teardown (the launcher goes on without it), if anything."""
    if outcome.returncode is None and not files.released.exists():
        return f"rank {outcome.rank} delivered its results but had not finished teardown; killed"
    if outcome.returncode not in (None, 0):
        return (f"rank {outcome.rank} delivered its results, then exited with "
                f"{outcome.signal_name or outcome.returncode} during teardown (ignored)")
    return None
