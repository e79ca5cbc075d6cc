"""Rank side: one step's gradients in step 0's array form (evidence/step0.py), for the step-0 gradients of the
fsdp run and the late gradients of a resume launch. Torch is imported inside the functions: only the ranks call
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...evidence import step0


def capture(names: list[str], params: list[Any], ctx: Any, step: int,
            prefixes: tuple[str, str]) -> tuple[Callable[[int], None], dict[str, np.ndarray]]:
    """A TrainStep ``inspect`` hook that keeps the gradients of ``step`` (after backward, before clipping) under
    ``prefixes``, and the dict it fills: this rank's shard of a sharded (FSDP2) gradient, rank 0's whole tensor
    of a replicated one. A parameter the loss does not use has no gradient: zero, as AdamW sees it."""
    arrays: dict[str, np.ndarray] = {}
    full_max = step0.full_max_of(ctx.config)

    def keep(current: int) -> None:
        if current != step:
            return
        for name, param in zip(names, params):
            arrays.update(_rank_arrays(name, param, ctx, full_max, prefixes))

    return keep, arrays


def _rank_arrays(name: str, param: Any, ctx: Any, full_max: int, prefixes: tuple[str, str]) -> dict[str, np.ndarray]:
    import torch

    grad = param.grad
    if hasattr(param, "to_local"):  # a DTensor shard on dim 0: merged across ranks by merge()
        local = grad.to_local() if grad is not None else torch.zeros_like(param.to_local())
        return step0.shard_arrays(name, local.float().cpu().numpy(), tuple(param.shape), ctx.rank, ctx.world_size,
                                  full_max, prefixes)
    if ctx.rank != 0:  # replicated (DDP): every rank holds the same reduced gradient
        return {}
    whole = grad if grad is not None else torch.zeros_like(param)
    return step0.shard_arrays(name, whole.detach().float().cpu().numpy(), tuple(param.shape), 0, 1, full_max,
                              prefixes)
