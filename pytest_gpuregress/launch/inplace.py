"""Run under torchrun/srun: this pytest process is one rank, and every rank runs the same tests.

One process group per session, from torchrun's environment. Records travel between ranks as JSON and
safetensors bytes in uint8 tensors, never pickled; every rank compares, only rank 0 writes references.
A rank that raises tells its peers through the store and tears its group down, so they fail at once.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import RankFailure
from ..reference.record import RunRecord
from . import flight
from .job import Job, RankFiles
from .spawn import LaunchResult, RankOutcome

EXIT_TIMEOUT = 124


def _gather_json(payload: dict[str, Any], device: str) -> list[dict[str, Any]]:
    return [json.loads(raw.decode()) for raw in _gather_bytes(json.dumps(payload).encode(), device)]


def _gather_arrays(arrays: dict[str, Any], device: str) -> list[dict[str, Any]]:
    import numpy as np
    from safetensors.numpy import load, save

    payload = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
    return [load(raw) for raw in _gather_bytes(payload, device)]


def _gather_bytes(payload: bytes, device: str) -> list[bytes]:
    import numpy as np
    import torch
    import torch.distributed as dist

    data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded)
    return [c[: int(s.item())].cpu().numpy().tobytes() for c, s in zip(chunks, sizes)]


def _agree_on_inputs(job: Job, local_rank: int) -> None:
    """Every rank's session built its config from its own node's files (a token file, a model config): ranks
    that disagree would train on different data or models and blame the stack. Refuse, naming the keys.
    Every rank reaches the same verdict from the same gathered data, so the group stays usable."""
    from ..reference.store import config_differences

    device = f"cuda:{local_rank}" if job.device_kind == "cuda" else "cpu"
    # What the config says of the files each node reads for itself: the model architectures (config files,
    # factories) and the token data. Temporary folders and install paths may differ between nodes; these may not.
    mine = {k: v for k, v in job.config.items() if k.endswith("architecture") or k == "tokens"}
    inputs = _gather_json(mine, device)
    for other, theirs in enumerate(inputs[1:], start=1):
        differences = config_differences(inputs[0], theirs, ("rank 0", f"rank {other}"))
        if differences:
            raise RankFailure(f"rank {other}'s node reads other files than rank 0's ({'; '.join(differences)}): "
                                  "give every node the same model configs (--gpuregress-model) and token file "
                                  "(--gpuregress-tokens)")


class InPlaceLauncher:
    """Runs a Job in this process, which torchrun already made one rank of the job."""

    def __init__(self, uncapture: Callable[[], None] = lambda: None) -> None:
        """``uncapture``: stop pytest capturing stderr, so a rank's last words reach the console."""
        self.uncapture = uncapture
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.launches = 0  # every rank runs the same launches in the same order: a shared key for each
        self.torn_down: str | None = None  # why the process group is gone (a launch failed)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def make_run_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"gpuregress-rank{self.rank}-"))

    def run(self, job: Job, wall_timeout_s: float) -> LaunchResult:
        import torch.distributed as dist

        from .worker import _init_process_group, execute_rank

        # Multi-node: torchrun's rendezvous and addresses, not a FileStore on loopback.
        job = replace(job, loopback_only=False)
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if self.torn_down is not None:
            # Building a second default group on torchrun's store in one process is not reliable
            # (its rendezvous keys are taken): later launches fail at once instead of hanging.
            raise RankFailure(f"not run: {self.torn_down}; under torchrun a session cannot rebuild its process "
                              "group, so rerun the remaining tests")
        if not dist.is_initialized():
            _init_process_group(job, self.rank, self.local_rank)
        _agree_on_inputs(job, self.local_rank)  # before the watchdog and the failure protocol: nothing ran yet
        self.launches += 1
        failure_key = f"gpuregress/launch-{self.launches}/failed"
        store = dist.distributed_c10d._get_default_store()
        watchdog = threading.Timer(wall_timeout_s, _time_out, (job, self.rank, wall_timeout_s, self.uncapture))
        watchdog.daemon = True
        watchdog.start()
        try:
            record, ctx = execute_rank(job, self.rank, self.local_rank, init_group=False)
            everyone = _gather_json(record.to_json(), ctx.device)
            arrays = _gather_arrays(record.arrays, ctx.device)
        except Exception as exc:  # noqa: BLE001 - every rank must learn which rank failed first
            failure = _fail_together(store, failure_key, self.rank, exc)
            self.torn_down = f"launch {self.launches} ({job.scenario}) failed and tore the process group down"
            raise failure from None
        finally:
            watchdog.cancel()
        records = [RunRecord.from_json(data) for data in everyone]
        for other, its_arrays in zip(records, arrays):
            other.arrays = its_arrays
        records[self.rank] = record
        outcomes = [RankOutcome(rank=r, status="delivered", returncode=None, last_progress=None)
                    for r in range(job.world_size)]
        return LaunchResult(records=records, outcomes=outcomes, wall_s=time.monotonic() - started)


def _fail_together(store: object, key: str, rank: int, exc: BaseException) -> RankFailure:
    """The first rank to fail posts its error and drops its connections; the others report that error."""
    import torch.distributed as dist

    first = None
    try:
        if store.check([key]):  # type: ignore[attr-defined]
            first = json.loads(store.get(key).decode())  # type: ignore[attr-defined]
        else:
            store.set(key, json.dumps({"rank": rank, "type": type(exc).__name__, "message": str(exc),  # type: ignore[attr-defined]
                                       "traceback": "".join(traceback.format_exception(exc))}))
    except Exception:  # noqa: BLE001 - the store is gone too: report this rank's own error
        first = None
    if dist.is_initialized():
        dist.destroy_process_group()  # peers blocked in a collective with this rank fail now
    if first is None or first["rank"] == rank:
        return RankFailure(f"rank {rank} raised {type(exc).__name__} (in place under torchrun)\n"
                           + "".join(traceback.format_exception(exc)))
    return RankFailure(f"rank {first['rank']} raised {first['type']}: {first['message']} (in place under torchrun; "
                       f"rank {rank} stopped with {type(exc).__name__} as a consequence)\n{first['traceback']}")


def _time_out(job: Job, rank: int, limit_s: float, uncapture: Callable[[], None]) -> None:
    """Past --gpuregress-timeout in place: say where this rank is, with its stacks, and leave."""
    with suppress(Exception):  # leaving matters more than the console
        uncapture()
    files = RankFiles(Path(job.run_dir), rank)
    state = flight.read(files.flight, rank)
    where = (f"in {state.label}" if state.inside else f"outside any collective (last: {state.label})") if state \
        else "before any collective"
    print(f"gpuregress: rank {rank} still running {job.scenario!r} at the time limit ({limit_s:.0f}s, "
          f"--gpuregress-timeout): last progress {files.last_progress() or 'none'}, {where}. Its stacks follow; "
          "it exits so that torchrun stops every rank.", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_TIMEOUT)
