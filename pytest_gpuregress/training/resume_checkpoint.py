"""Rank side: a training run's whole state at a step, in a folder safe to ship, and back into a fresh trainer.

Safetensors and JSON only (layout: docs/checkpoint.md); the file written last marks a finished save. The
load passes the fault points every resume shares, the checkpoint scenario's too: ``apply_model``,
``apply_optimizer`` (below) and ``rng_state.restore``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointProblem
from ..fault_points import fault_point
from ..reference import atomic
from . import dcp_safetensors, rng_state, state_digests

FORMAT = "gpuregress-resume-checkpoint/1"
TENSORS = "tensors"
TRAINER_JSON = "trainer.json"


@fault_point("checkpoint.apply_model")
def apply_model(trainer: Resumable, model_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(trainer.model, model_state)


@fault_point("checkpoint.apply_optimizer")
def apply_optimizer(trainer: Resumable, optim_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state)


class Resumable(state_digests.TrainingState, Protocol):
    """A model under FSDP2, its optimizer and its LR schedule, with the parameters' names."""

    model: Any


def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank}.json"


def _state_dicts(trainer: Resumable) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts keyed by parameter name; initialises a fresh optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(trainer.model, trainer.optimizer)


def save(trainer: Resumable, folder: Path, *, step: int, data_position: int, rank: int, world_size: int,
         device_kind: str) -> None:
    """Write the state after ``step`` optimizer steps into ``folder`` (every rank sees it). Collective."""
    import torch
    import torch.distributed as dist

    model_state, optim_state = _state_dicts(trainer)
    dcp_safetensors.save({"model": model_state, "optim": optim_state["state"]}, folder / TENSORS)
    atomic.write_json(rng_file(folder, rank), rng_state.capture(device_kind))
    dist.barrier()
    if rank == 0:
        atomic.write_json(folder / TRAINER_JSON, {
            "format": FORMAT, "step": step, "data_position": data_position, "world_size": world_size,
            "param_groups": optim_state["param_groups"], "scheduler": state_digests.scheduler_state(trainer),
            "torch": torch.__version__,
        })
    dist.barrier()


def read_json(path: Path, what: str, fix: str = "record the reference again") -> dict[str, Any]:
    """A checkpoint's JSON object; a clear CheckpointProblem naming the file and ``fix`` otherwise."""
    if not path.is_file():
        raise CheckpointProblem(path, None, f"missing: the checkpoint has no {what}", fix)
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointProblem(path, None, f"not JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise CheckpointProblem(path, None, "not a JSON object", fix)
    return data


def read_meta(folder: Path, fmt: str = FORMAT, fix: str = "record the reference again") -> dict[str, Any]:
    """trainer.json, checked for its format ``fmt``."""
    meta = read_json(folder / TRAINER_JSON, "trainer state (trainer.json), so its save did not finish", fix)
    if meta.get("format") != fmt:
        raise CheckpointProblem(folder / TRAINER_JSON, None, f"format {meta.get('format')!r}, expected {fmt!r}",
                                f"{fix} with this version")
    return meta


def detached_copies(state: dict[str, Any]) -> dict[str, Any]:
    """Detached copies to load into, so the load and the apply are separate steps a fault can tell apart."""
    return {k: detached_copies(v) if isinstance(v, dict) else v.detach().clone() for k, v in state.items()}


def load(trainer: Resumable, folder: Path, *, rank: int, device_kind: str) -> dict[str, Any]:
    """Restore a fresh trainer from ``folder`` (read only); return trainer.json. Collective. The generators are
    this rank's as saved: the world size must be the saving one's."""
    meta = read_meta(folder)
    if not dcp_safetensors.shard_files(folder / TENSORS):
        raise CheckpointProblem(folder / TENSORS, None, "no safetensors shard here", "record the reference again")
    model_state, optim_state = _state_dicts(trainer)
    loaded = {"model": detached_copies(model_state), "optim": detached_copies(optim_state["state"])}
    # The files passed their manifest: a refusal is this stack's DCP not reading what the reference's stack wrote.
    with dcp_safetensors.refused_as_problem(folder / TENSORS, "a checkpoint bug of this stack: report it against "
                                            "torch.distributed.checkpoint, with the torch versions on both sides"):
        dcp_safetensors.load(loaded, folder / TENSORS)
    apply_model(trainer, loaded["model"])
    apply_optimizer(trainer, {"state": loaded["optim"], "param_groups": meta["param_groups"]})
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **meta["scheduler"]})
    rng_state.restore(read_json(rng_file(folder, rank), f"generator state of rank {rank}"), device_kind)
    return meta
