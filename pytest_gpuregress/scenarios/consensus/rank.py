"""The consensus workload on one rank, which stands for one device: run it, digest it, say who we are.

No collective call: its numbers are a world-size-1 run's. It hands back digests, identity and group key; only
rank 0 sends the tensor names, the others a hash of theirs, so a rank that ran another workload shows.
"""

from __future__ import annotations

import time

from ...reference.record import RunRecord
from ...stack import device_identity as identity
from ..base import RankContext
from .digest import names_digest
from .group_key import group_key


def run(ctx: RankContext) -> RunRecord:
    import torch

    from ...stack.fingerprint import collect
    from ...stack.platforms import gpu_arch
    from .workload import run_all

    started = time.perf_counter()
    digests = run_all(ctx.device, ctx.config)
    seconds = time.perf_counter() - started
    ctx.progress(f"{len(digests.names)} tensors digested")
    who = identity.probe(ctx.rank, ctx.local_rank, ctx.device_kind, torch)
    stack = collect(ctx.device_kind)
    on_gpu = ctx.device_kind == "cuda"  # the fingerprint describes device 0; the key takes this device's own
    own = {"identity": who, "key": group_key(stack, who["model"] if on_gpu else None,
                                             gpu_arch(torch, ctx.local_rank) if on_gpu else None),
           "names_sha": names_digest(digests.names), "firmware": who["firmware"] or (stack.get("device") or {}).get("firmware"),
           "seconds": seconds, "tensors": len(digests.names)}
    if ctx.rank == 0:
        own.update(names=digests.names, kinds=digests.kinds)
    return RunRecord(scenario="consensus", config=dict(ctx.config), platform_key="", world_size=ctx.world_size,
                     arrays=digests.arrays(), results={"consensus": own})
