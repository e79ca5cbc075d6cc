"""Run under torchrun/srun: this pytest process is one rank, and every rank runs the same tests.

The process group is created once from torchrun's environment (its addresses, its store) and
reused by every test. Per-rank records travel to all ranks as JSON bytes and their arrays as
safetensors bytes, in uint8 tensors: never pickled, so ``all_gather_object`` is not used. Arrays
are per-rank (a rank's step-0 gradient shard), and small: step-0 gradients of large tensors are
block summaries (reference/step0.py). Every rank then compares, so every rank reaches the same
verdict; only rank 0 writes references.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..reference.record import RunRecord
from .job import Job
from .spawn import LaunchResult, RankOutcome


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


class InPlaceLauncher:
    """Runs a Job in this process, which torchrun already made one rank of the job."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))

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
        if not dist.is_initialized():
            _init_process_group(job, self.rank, self.local_rank)
        record, ctx = execute_rank(job, self.rank, self.local_rank, init_group=False)
        everyone = _gather_json(record.to_json(), ctx.device)
        arrays = _gather_arrays(record.arrays, ctx.device)
        records = []
        for rank, data in enumerate(everyone):
            if rank == self.rank:
                records.append(record)
                continue
            other = RunRecord.from_json(data)
            other.arrays = arrays[rank]
            records.append(other)
        outcomes = [RankOutcome(rank=r, status="delivered", returncode=None, last_progress=None)
                    for r in range(job.world_size)]
        return LaunchResult(records=records, outcomes=outcomes, wall_s=time.monotonic() - started)
