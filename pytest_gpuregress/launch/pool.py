"""Rank processes that outlive one launch: started once, then fed one job after another.

Importing torch costs a rank seconds and a session runs dozens of launches. Groups are kept per (world
size, device, environment) and reused only after a clean job; any other end kills the whole group.
Ranks die with the launcher (stdin EOF, and a parent-death SIGKILL). docs/launching.md has the rest.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

from .job import Job
from .net import loopback_env
from .template import VOLATILE_ENV, ForkedRank, Templates

# Idle groups kept for reuse. Each rank holds torch and transformers (a few hundred MB on the CPU).
MAX_IDLE_GROUPS = 2
CLOSE_GRACE_S = 5.0

EnvKey = tuple[int, str, bool, tuple[tuple[str, str], ...]]
Rank = subprocess.Popen[bytes] | ForkedRank
Kept = TypeVar("Kept", "WorkerPool", Templates)


def rank_environment(job: Job) -> dict[str, str]:
    """The environment every rank of ``job`` starts with (without RANK/LOCAL_RANK)."""
    env = dict(os.environ)
    if job.loopback_only:
        env.update(loopback_env())
    env.update(job.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["WORLD_SIZE"] = str(job.world_size)
    env["GPUREGRESS_SPAWNED"] = "1"
    env["GPUREGRESS_PARENT_PID"] = str(os.getpid())
    return env


def group_key(job: Job) -> EnvKey:
    env = {k: v for k, v in rank_environment(job).items() if k not in VOLATILE_ENV}
    return job.world_size, job.device_kind, job.loopback_only, tuple(sorted(env.items()))


def _close_stdin(proc: Rank) -> None:
    if proc.stdin is not None:
        with suppress(OSError):
            proc.stdin.close()


class RankGroup:
    """``world_size`` serving rank processes, each in its own session so its tree can be killed."""

    def __init__(self, job: Job, base_dir: Path | None = None) -> None:
        self.key = group_key(job)
        self.world_size = job.world_size
        self.log_dir = Path(tempfile.mkdtemp(prefix="gpuregress-ranks-", dir=base_dir))
        env = rank_environment(job)
        self.procs: list[Rank] = [self._start(rank, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), job.device_kind)
                                  for rank in range(job.world_size)]

    def _start(self, rank: int, env: dict[str, str], device_kind: str) -> Rank:
        """Forked from a template that has imported torch and the libraries (template.py), on the CPU; else a new
        interpreter that imports them itself."""
        forked = shared_templates().fork(rank, env, self.startup_log(rank)) if device_kind == "cpu" else None
        if forked is not None:
            return forked
        with open(self.startup_log(rank), "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "pytest_gpuregress.launch.worker", "--serve", str(rank)],
                                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def startup_log(self, rank: int) -> Path:
        """Where a rank writes before its first job and between jobs (import errors land here)."""
        return self.log_dir / f"rank{rank}.log"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def submit(self, job_path: Path) -> None:
        """Hand every rank the job; a rank that already died is left for the watcher to report."""
        for proc in self.procs:
            with suppress(OSError):  # a broken pipe too
                assert proc.stdin is not None
                proc.stdin.write(f"{job_path}\n".encode())
                proc.stdin.flush()

    def close(self) -> None:
        """Let idle ranks leave on their own (EOF on stdin), then kill whatever is left."""
        for proc in self.procs:
            _close_stdin(proc)
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:  # also for ranks that exited: children they started may live on
            with suppress(PermissionError, ProcessLookupError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # not yet a group of its own (a forked rank before its setsid): the rank alone
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            _close_stdin(proc)
        shutil.rmtree(self.log_dir, ignore_errors=True)


class WorkerPool:
    """Idle rank groups by environment key, least recently used first out."""

    def __init__(self) -> None:
        self.idle: OrderedDict[EnvKey, RankGroup] = OrderedDict()
        self.started = 0  # groups started this session, for the benchmark and the tests

    def acquire(self, job: Job) -> RankGroup:
        group = self.idle.pop(group_key(job), None)
        if group is not None and group.alive():
            return group
        if group is not None:
            group.kill()
        self.started += 1
        return RankGroup(job)

    def release(self, group: RankGroup) -> None:
        """Keep a group that finished a job cleanly for the next launch with its environment."""
        self.idle[group.key] = group
        while len(self.idle) > MAX_IDLE_GROUPS:
            _, oldest = self.idle.popitem(last=False)
            oldest.close()

    def close(self) -> None:
        while self.idle:
            _, group = self.idle.popitem(last=False)
            group.close()


def shared_pool() -> WorkerPool:
    """The process's pool: sessions come and go, ranks stay until the process exits."""
    return _kept_on_package("_shared_worker_pool", WorkerPool)


def shared_templates() -> Templates:
    """The process's rank templates (template.py); closed at exit, and ranks still running die with their template."""
    return _kept_on_package("_rank_templates", Templates)


def _kept_on_package(attribute: str, make: Callable[[], Kept]) -> Kept:
    """One per process, closed at exit. Kept on the top-level package, not in this module: pytester's inline runs
    drop the modules a run imported, and ranks held by a dropped module would stay alive, unreachable."""
    import pytest_gpuregress as anchor

    kept = getattr(anchor, attribute, None)
    if kept is None:
        kept = make()
        setattr(anchor, attribute, kept)
        atexit.register(kept.close)
    return kept
