"""Rank side: digests of every piece of training state, so a difference can be named piece by piece.

Pieces: ``model`` (every parameter), ``optimizer.exp_avg``, ``optimizer.exp_avg_sq`` and
``optimizer.step`` (per parameter), ``optimizer.param_groups`` (the learning rate and the other
hyperparameters), ``lr_scheduler`` (its own state),
``data.position``, and per rank ``rng.python``, ``rng.numpy``, ``rng.torch_cpu`` and, on GPUs,
``rng.torch_device``. Sharded tensors are gathered whole (``full_tensor``, a collective: every
rank calls these in the same order), so digests do not depend on the world size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import rng
from .trainer import Trainer

OPTIMIZER_PIECES = ("exp_avg", "exp_avg_sq", "step")


def to_numpy(tensor: Any) -> np.ndarray:
    """The whole tensor on the CPU: a DTensor is gathered from every rank (collective)."""
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return np.array(whole.detach().cpu().numpy(), order="C")  # a copy; keeps 0-d (ascontiguousarray would not)


def sha(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def full_tensors(trainer: Trainer) -> Iterator[tuple[str, str, np.ndarray]]:
    """(piece, parameter name, whole tensor) for the weights and the optimizer state. Collective."""
    for name, param in zip(trainer.names, trainer.params):
        yield "model", name, to_numpy(param)
        state = trainer.optimizer.state.get(param, {})
        for piece in OPTIMIZER_PIECES:
            if piece in state:
                yield f"optimizer.{piece}", name, to_numpy(state[piece])


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


def _json_sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def scheduler_state(trainer: Trainer) -> dict[str, Any]:
    """The scheduler's own state, JSON-serialisable (its lambdas are code, not state)."""
    return {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}


def param_groups(trainer: Trainer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters per group, the learning rate the scheduler set among them."""
    return [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]


def boundary(trainer: Trainer, device_kind: str, rank: int) -> dict[str, dict[str, str]]:
    """piece -> item -> sha256 of everything a resumed run must restore. Collective (the tensors).

    The generators are this rank's only (items "rank<r>"); the scenario merges every rank's."""
    out: dict[str, dict[str, str]] = {}
    for piece, name, values in full_tensors(trainer):
        # The step count is shown as it is: "5.0 -> 1.0" says more than two hashes.
        out.setdefault(piece, {})[name] = repr(float(values)) if piece == "optimizer.step" else sha(values)
    out["optimizer.param_groups"] = {f"group{i}": _json_sha(g) for i, g in enumerate(param_groups(trainer))}
    out["lr_scheduler"] = {"state": _json_sha(scheduler_state(trainer))}
    out["data.position"] = {"position": str(trainer.data.position)}
    for piece, digest in rng.digests(rng.capture(device_kind)).items():
        out[piece] = {f"rank{rank}": digest}
    return out
