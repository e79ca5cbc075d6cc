"""One rank of a locally spawned group: ``python -m pytest_gpuregress.launch.worker --serve RANK``.

Per job, in this order: write the record and ``done``; barrier; destroy the group, undo faults, write
``released``. A failed rank leaves with ``os._exit``, skipping the finalisation where gloo's threads can
abort the process; an abort after ``done`` loses nothing.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..reference import atomic
from .job import Job, RankFiles

if TYPE_CHECKING:
    from ..reference.record import RunRecord
    from ..scenarios.base import RankContext

EXIT_SCENARIO_ERROR = 3
EXIT_TEARDOWN_FAILED = 4
EXIT_DEVICE_UNUSABLE = 5


def _init_process_group(job: Job, rank: int, local_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from . import torch_trace

    # torch reads whether to dump on a watchdog timeout when the group is created: in place (inplace.py) the group
    # is created here before any job ran, so before execute_rank's own call (idempotent: the same folder, no change).
    torch_trace.arm(Path(job.run_dir), job.backend)
    kwargs: dict[str, Any] = {}
    if job.device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if job.loopback_only:
        # A FileStore, not a TCPStore: TCPStore listens on every interface even when given 127.0.0.1.
        kwargs["store"] = dist.FileStore(str(Path(job.run_dir) / "filestore"), job.world_size)
        kwargs.update(rank=rank, world_size=job.world_size)
    # else: torchrun's env:// rendezvous, on the addresses the user gave torchrun
    dist.init_process_group(backend=job.backend, timeout=timedelta(seconds=job.timeout_s), **kwargs)


def _teardown(job: Job) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if job.backend == "gloo":
            # monitored_barrier names a missing rank instead of blocking forever
            dist.monitored_barrier(timeout=timedelta(seconds=max(job.timeout_s, 10)))
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def execute_rank(job: Job, rank: int, local_rank: int, *, init_group: bool = True) -> tuple[RunRecord, RankContext]:
    """Run the scenario as one rank; shared by the spawned worker and the in-place launcher."""
    from .. import faults
    from ..faults import firing
    from ..scenarios import resolve_entry
    from ..scenarios.base import RankContext
    from ..stack.determinism import set_determinism
    from ..stack.fingerprint import collect
    from . import flight, torch_trace
    from .net import listening_addresses

    files = RankFiles(Path(job.run_dir), rank)
    ctx = RankContext(
        rank=rank,
        world_size=job.world_size,
        local_rank=local_rank,
        device_kind=job.device_kind,
        backend=job.backend,
        config=job.config,
        run_dir=Path(job.run_dir),
        progress_path=files.progress,
        watch=job.watch,
        profile=job.profile,
    )
    ctx.progress("start")
    try:  # from the first installed patch on: whatever raises, every patch is undone (ranks outlive a job)
        installed = faults.install_counted(job.faults, ctx)
        # after the faults: it sees the calls the scenario makes; on NCCL/RCCL it reads completion from each Work
        flight.install(files.flight, ctx.cleanup_hooks, job.backend)
        # torch's own dump, on NCCL/RCCL, into this job's folder (in place, a later job moves it from the first's),
        # and a thread that writes it when the launcher asks at its limit, stopped by the cleanup hooks.
        torch_trace.arm(Path(job.run_dir), job.backend)
        torch_trace.serve_requests(Path(job.run_dir), rank, job.backend, ctx.cleanup_hooks)
        run_scenario = resolve_entry(job.scenario)
        switches = set_determinism(int(job.config.get("seed", 0)), device_kind=job.device_kind)
        if init_group:
            _init_process_group(job, rank, local_rank)
        ctx.progress("process group ready")
        if job.collect_fingerprint and rank == 0:
            ctx.fingerprint = collect(job.device_kind, job.backend, job.world_size, switches,
                                      bf16=job.config.get("dtype") == "bf16")
        record = run_scenario(ctx)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    record.fingerprint = record.fingerprint or ctx.fingerprint
    if ctx.stopped is not None:
        record.results["fail_fast"] = ctx.stopped
    if job.faults:  # the launcher sums the ranks' counts and writes the notes (plugin/launches.py, faults/firing.py)
        record.results[firing.RESULT_KEY] = firing.rank_counts(installed)
    if job.loopback_only:
        record.results.setdefault("listening", {})[str(rank)] = listening_addresses()
    return record, ctx


def die_with_parent() -> None:
    """SIGKILL this rank when the launcher dies, even by SIGKILL; a watchdog thread where prctl is missing."""
    parent = int(os.environ.get("GPUREGRESS_PARENT_PID", os.getppid()))
    with suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() == parent:
            return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="gpuregress-parent-watchdog", daemon=True).start()


@contextmanager
def _job_stdio(files: RankFiles) -> Iterator[None]:
    """Send fds 1 and 2 to the job's rank log for the job's duration, and stacks on SIGUSR1 to its file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    log = os.open(files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    stack_file = open(files.stack, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        faulthandler.unregister(signal.SIGUSR1)
        stack_file.close()
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
            os.close(kept)


@contextmanager
def _job_environment() -> Iterator[None]:
    """Give the next job the environment this rank started with, and no leftover library singletons: a scenario may
    set variables (lora sets LOCAL_WORLD_SIZE) or build process-wide state (accelerate's AcceleratorState keeps the
    first job's FSDP plugin)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        state = sys.modules.get("accelerate.state")
        if state is not None:
            state.AcceleratorState._reset_state(True)


@contextmanager
def _job_directory(cwd: str) -> Iterator[None]:
    """Work in the launcher's directory for one job, and forget the modules imported from it: a user's scenario
    module (``user_scenario:train``) is imported from there, and the next job may come from another directory with
    a module of the same name."""
    previous, modules = os.getcwd(), set(sys.modules)
    if not cwd:
        yield
        return
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        root = os.path.join(os.path.realpath(cwd), "")
        installed = tuple(os.path.join(os.path.realpath(p), "") for p in {sys.prefix, sys.base_prefix})
        for name in set(sys.modules) - modules:
            where = os.path.realpath(getattr(sys.modules[name], "__file__", None) or "")
            # Installed packages stay (torch cannot be imported twice), even with a venv inside the directory.
            if where.startswith(root) and not where.startswith(installed) and not name.startswith("pytest_gpuregress"):
                del sys.modules[name]
        sys.path.remove(cwd)
        os.chdir(previous)


def serve_job(job_path: Path, rank: int) -> int:
    """Run one job as ``rank``; return 0 when this rank may serve another."""
    job = Job.load(job_path)
    files = RankFiles(Path(job.run_dir), rank)
    with _job_stdio(files), _job_directory(job.cwd), _job_environment():
        try:  # the record and the done marker are delivered before any teardown
            record, ctx = execute_rank(job, rank, rank)
            record.save(files.record_dir)
            files.done.write_text("delivered\n")
            ctx.progress("delivered")
            for hook in ctx.teardown_hooks:
                hook()
            _teardown(job)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
            if not files.done.exists():
                atomic.write_json(files.error, {
                    "type": type(exc).__name__, "message": str(exc), "last_progress": files.last_progress(),
                    "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))})
                return EXIT_SCENARIO_ERROR
            print(f"rank {rank}: teardown failed after delivering results: {exc!r}", file=sys.stderr)
            return EXIT_TEARDOWN_FAILED
        finally:
            gc.collect()  # drop the job's tensors before the next job builds its own
        broken = _release_device_memory(job)
    if broken:  # a sticky CUDA/HIP error: every later call fails the same way, so this process is done
        files.device_error.write_text(f"{broken}\n")
        return EXIT_DEVICE_UNUSABLE
    files.released.write_text("released\n")
    return 0


def _release_device_memory(job: Job) -> str | None:
    """Wait for the job's device work and free its cache; the error when the device context is unusable."""
    if job.device_kind != "cuda":
        return None
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - any failure here means the context cannot serve another job
        return f"{type(exc).__name__}: {exc}"
    return None


def serve(rank: int) -> None:
    die_with_parent()
    if sys.path and sys.path[0] == os.getcwd():  # `python -m` put the start-up directory first; jobs bring theirs
        sys.path.pop(0)
    faulthandler.enable(file=sys.stderr)
    code = 0
    for line in sys.stdin:
        code = serve_job(Path(line.strip()), rank)
        if code:
            break  # a rank that failed is never reused
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--serve":
        sys.exit("usage: python -m pytest_gpuregress.launch.worker --serve RANK (started by launch/pool.py)")
    serve(int(sys.argv[2]))
