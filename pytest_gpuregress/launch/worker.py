"""One rank of a locally spawned group: ``python -m pytest_gpuregress.launch.worker JOB RANK``.

Order matters here, and it is what makes teardown crashes harmless:
  1. run the scenario and write the record, then the ``done`` marker (results are delivered);
  2. barrier, so no rank tears its transport down while a peer still talks to it;
  3. destroy the process group, flush stdio, and leave with ``os._exit``.
Step 3 skips interpreter finalisation. Gloo's worker threads can still hold work objects that
reference Python tensors; destroying those during finalisation aborts the process
("terminate called without an active exception"). ``os._exit`` never runs that code, and any
abort that still happens after step 1 cannot lose results: the launcher only needs the marker.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..reference import atomic
from .job import Job, RankFiles

if TYPE_CHECKING:
    from ..reference.record import RunRecord
    from ..scenarios.base import RankContext

EXIT_SCENARIO_ERROR = 3


def _init_process_group(job: Job, rank: int, local_rank: int) -> None:
    import torch
    import torch.distributed as dist

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


def _write_error(files: RankFiles, exc: BaseException) -> None:
    payload = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "last_progress": files.last_progress(),
    }
    atomic.write_json(files.error, payload)


def execute_rank(job: Job, rank: int, local_rank: int, *, init_group: bool = True) -> tuple[RunRecord, RankContext]:
    """Run the scenario as one rank; shared by the spawned worker and the in-place launcher."""
    from .. import faults
    from ..scenarios import resolve_entry
    from ..scenarios.base import RankContext
    from ..stack.determinism import set_determinism
    from ..stack.fingerprint import collect
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
    )
    ctx.progress("start")
    installed = faults.install(job.faults, ctx)
    run_scenario = resolve_entry(job.scenario)
    switches = set_determinism(int(job.config.get("seed", 0)), device_kind=job.device_kind)
    if init_group:
        _init_process_group(job, rank, local_rank)
    ctx.progress("process group ready")
    if job.collect_fingerprint and rank == 0:
        ctx.fingerprint = collect(job.device_kind, job.backend, job.world_size, switches)
    try:
        record = run_scenario(ctx)
    finally:
        for undo in reversed(ctx.cleanup_hooks):  # in place, the process runs later tests too
            undo()
    record.fingerprint = record.fingerprint or ctx.fingerprint
    record.notes.extend(f"fault injected: {spec}" for spec in installed)
    if job.loopback_only:
        record.results.setdefault("listening", {})[str(rank)] = listening_addresses()
    return record, ctx


def run_rank(job: Job, rank: int) -> None:
    """Spawned rank: run, then deliver the record and the done marker before any teardown."""
    files = RankFiles(Path(job.run_dir), rank)
    record, ctx = execute_rank(job, rank, rank)
    record.save(files.record_dir)
    files.done.write_text("delivered\n")
    ctx.progress("delivered")
    for hook in ctx.teardown_hooks:
        hook()


def main(argv: list[str]) -> None:
    job = Job.load(Path(argv[0]))
    rank = int(argv[1])
    files = RankFiles(Path(job.run_dir), rank)
    stack_file = open(files.stack, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr)
    code = 0
    try:
        run_rank(job, rank)
        _teardown(job)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        if not files.done.exists():
            _write_error(files, exc)
            code = EXIT_SCENARIO_ERROR
        else:
            print(f"rank {rank}: teardown failed after delivering results: {exc!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
