"""A user's own model and training loop, checked against a stored reference on every run.

A small classifier trained with AdamW on deterministic data, split over the ranks with FSDP2
(``config["parallel"] = "ddp"`` replicates it with DistributedDataParallel instead). The
``Recorder`` collects what a regression moves; the test beside this file runs it on every rank
through the ``gpuregress`` fixture and compares the record with its reference.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuregress import Recorder
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import RankContext

FEATURES, HIDDEN, CLASSES, GLOBAL_BATCH = 16, 64, 4, 32


def batch(step: int, rank: int, world_size: int, device: str) -> tuple[Any, Any]:
    """This rank's rows of the global batch of ``step``: the same global batch at any world size."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)  # per step, not per rank: data never depends on the split
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7))
    y = (x @ teacher).argmax(dim=1)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    return x[rows].to(device), y[rows].to(device)


def train(ctx: RankContext) -> RunRecord:
    """Runs on every rank; torch is imported here, not when pytest collects the test."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(int(ctx.config.get("seed", 0)))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, CLASSES)).to(ctx.device)
    if ctx.config.get("parallel", "fsdp") == "fsdp":
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=float(ctx.config.get("lr", 1e-2)))

    rec = Recorder(ctx, "own-loop", model=model)  # model=: noise replicas may nudge its weights
    for step in range(int(ctx.config["steps"])):
        x, y = (rec.batch(t) for t in batch(step, ctx.rank, ctx.world_size, ctx.device))  # a replica may reorder rows
        with rec.phase("forward"):  # step 0's op trace: a failure names the first op whose output moved
            loss = torch.nn.functional.cross_entropy(model(x), y)
        with rec.phase("backward"):
            loss.backward()
        rec.gradients(model)  # per-parameter norms every step, whole gradients at step 0
        with rec.phase("clip"):
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with rec.phase("optimizer"):
            opt.step()
        opt.zero_grad()
        if rec.step(loss, grad_norm=grad_norm):  # True: --gpuregress-fail-fast stops the run here
            break
    rec.weights(model)  # digests of the final weights
    return rec.record()
