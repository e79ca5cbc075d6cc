"""The consensus workload on one rank, which stands for one device: run it, digest it, say who we are.

The rank runs the single-device workload (workload.py) on its own device and makes no collective call: its
numbers are those of a world size 1 run. It hands back only its digests (24 bytes a tensor, as arrays) and its
identity (host, node, local index, bus id, UUID, serial) with its group key (device model and stack); the
launcher gathers these from every rank (files when spawned, an all-gather of the records under torchrun) and
the session votes (vote.py). Rank 0 alone also sends the tensor names, which every rank shares; the others
send a hash of theirs, so a rank that ran another workload is told apart.
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
