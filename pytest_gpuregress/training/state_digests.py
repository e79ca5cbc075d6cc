"""Rank side: digests of every piece of training state, so a difference can be named piece by piece.

Model, optimizer moments and step, param groups, scheduler, data position and each generator. Sharded
tensors are gathered whole (a collective), so digests do not depend on the world size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from . import rng_state

OPTIMIZER_PIECES = ("exp_avg", "exp_avg_sq", "step")


class TrainingState(Protocol):
    """What a digest reads of a trainer: its parameters by name, its optimizer and its schedule."""

    names: list[str]

    @property
    def params(self) -> list[Any]: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Any: ...


def to_numpy(tensor: Any) -> np.ndarray:
    """The whole tensor on the CPU: a DTensor is gathered from every rank (collective)."""
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return np.array(whole.detach().cpu().numpy(), order="C")  # a copy; keeps 0-d (ascontiguousarray would not)


def sha(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def full_tensors(state: TrainingState) -> Iterator[tuple[str, str, np.ndarray]]:
    """(piece, parameter name, whole tensor) for the weights and the optimizer state. Collective."""
    for name, param in zip(state.names, state.params):
        yield "model", name, to_numpy(param)
        held = state.optimizer.state.get(param, {})
        for piece in OPTIMIZER_PIECES:
            if piece in held:
                yield f"optimizer.{piece}", name, to_numpy(held[piece])


def json_sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def scheduler_state(state: TrainingState) -> dict[str, Any]:
    """The scheduler's own state, JSON-serialisable (its lambdas are code, not state)."""
    return {k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"}


def param_groups(state: TrainingState) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters per group, the learning rate the scheduler set among them."""
    return [{k: v for k, v in group.items() if k != "params"} for group in state.optimizer.param_groups]


def boundary(state: TrainingState, data_position: int, device_kind: str, rank: int) -> dict[str, dict[str, str]]:
    """piece -> item -> sha256 of all a resumed run must restore. Collective. Generators: this rank's only
    (items "rank<r>"); the session merges every rank's."""
    out: dict[str, dict[str, str]] = {}
    for piece, name, values in full_tensors(state):
        # The step count is shown as it is: "5.0 -> 1.0" says more than two hashes.
        out.setdefault(piece, {})[name] = repr(float(values)) if piece == "optimizer.step" else sha(values)
    # Weights saved and loaded but never trained (a lora base): a fresh trainer builds them equal to the saved
    # ones, so the resume scrambles them first (scramble_frozen) and a load that skips them shows here.
    for name, param in getattr(state, "frozen", []):
        out.setdefault("model.frozen", {})[name] = sha(to_numpy(param))
    out["optimizer.param_groups"] = {f"group{i}": json_sha(g) for i, g in enumerate(param_groups(state))}
    out["lr_scheduler"] = {"state": json_sha(scheduler_state(state))}
    out["data.position"] = {"position": str(data_position)}
    for piece, digest in rng_state.digests(rng_state.capture(device_kind)).items():
        out[piece] = {f"rank{rank}": digest}
    return out


def scramble_frozen(state: TrainingState) -> None:
    """Zero the trainer's frozen weights (``frozen``: name, tensor pairs, where it has them) before a load."""
    import torch

    with torch.no_grad():
        for _, param in getattr(state, "frozen", []):
            param.zero_()


def as_saved(digests: dict[str, dict[str, str]], state: TrainingState, saved_groups: list[dict[str, Any]],
             saved_scheduler: dict[str, Any]) -> None:
    """Digest the param groups and scheduler over the keys the checkpoint saved, in place: another torch may add a
    key with its default on load, which is no piece the checkpoint lost."""
    live = param_groups(state)
    digests["optimizer.param_groups"] = {
        f"group{i}": json_sha({k: group.get(k) for k in saved if k != "params"})
        for i, (group, saved) in enumerate(zip(live, saved_groups))}
    scheduler = scheduler_state(state)
    digests["lr_scheduler"] = {"state": json_sha({k: scheduler.get(k) for k in saved_scheduler})}
