"""Rank side: digests of a checkpoint trainer's state (training/state_digests.py), and the full-tensor
hashes with their chunks that a reshard must preserve.

Sharded tensors are gathered whole (``full_tensor``, a collective: every rank calls these in the same order),
so digests do not depend on the world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...training import state_digests
from ...training.state_digests import full_tensors, scheduler_state, sha, to_numpy
from .trainer import Trainer

__all__ = ["boundary", "chunk_hashes", "scheduler_state", "tensor_hashes", "to_numpy"]


def chunk_hashes(values: np.ndarray, chunks: int) -> list[str]:
    """sha256 of each of ``chunks`` pieces along dim 0, cut as FSDP2 cuts shards (torch.chunk)."""
    if values.ndim == 0 or chunks <= 1:
        return [sha(values)]
    size = -(-values.shape[0] // chunks)
    return [sha(values[i : i + size]) for i in range(0, values.shape[0], size)]


def tensor_hashes(trainer: Trainer, chunks: int) -> dict[str, dict[str, dict[str, Any]]]:
    """piece -> parameter -> {sha256, shape, chunks}: what a reshard must preserve. Collective."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for piece, name, values in full_tensors(trainer):
        out.setdefault(piece, {})[name] = {"sha256": sha(values), "shape": list(values.shape),
                                           "chunks": chunk_hashes(values, chunks)}
    return out


def boundary(trainer: Trainer, device_kind: str, rank: int) -> dict[str, dict[str, str]]:
    """piece -> item -> sha256 of everything a resumed run must restore. Collective (the tensors)."""
    return state_digests.boundary(trainer, trainer.data.position, device_kind, rank)
