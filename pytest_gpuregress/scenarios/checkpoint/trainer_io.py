"""Rank side: a trainer's whole state in a checkpoint folder, and back into a freshly built trainer.

Tensors via DCP, generators per rank and the rest as JSON (layout: docs/checkpoint.md); ``trainer.json`` is
written last, so its presence means complete. Fault points ``apply_model`` and ``apply_optimizer`` are shared
with every resume (training/resume_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...reference import atomic
from ...training import resume_checkpoint
from ...training import rng_state as rng
from ...training.resume_checkpoint import apply_model, apply_optimizer, detached_copies, read_json
from ...training.state_digests import scheduler_state
from . import hooks, sharded
from .trainer import Trainer

FORMAT = "gpuregress-trainer-checkpoint/1"
TENSORS = "tensors"
TRAINER_JSON = "trainer.json"
SAVE_AGAIN = "save it again"  # the fix: this scenario wrote the checkpoint moments before


def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank}.json"


def _state_dicts(trainer: Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts keyed by parameter name; initialises a fresh optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(trainer.model, trainer.optimizer)


def save(trainer: Trainer, folder: Path, step: int, device_kind: str) -> None:
    """Write the trainer's state after ``step`` steps into ``folder``. Collective."""
    import torch.distributed as dist

    model_state, optim_state = _state_dicts(trainer)
    sharded.save({"model": model_state, "optim": optim_state["state"]}, folder / TENSORS)
    atomic.write_json(rng_file(folder, trainer.rank), rng.capture(device_kind))
    dist.barrier()
    if trainer.rank == 0:
        atomic.write_json(folder / TRAINER_JSON, {
            "format": FORMAT, "step": step, "world_size": trainer.world_size,
            "param_groups": optim_state["param_groups"],
            "scheduler": scheduler_state(trainer),
            "data_position": trainer.data.position,
        })
    dist.barrier()


def load(trainer: Trainer, folder: Path, *, with_rng: bool, device_kind: str) -> dict[str, Any]:
    """Restore a freshly built trainer from ``folder`` at this run's world size; return trainer.json. Collective.

    ``with_rng``: restore this rank's generators too (only meaningful at the world size that saved)."""
    meta = resume_checkpoint.read_meta(folder, FORMAT, SAVE_AGAIN)
    model_state, optim_state = _state_dicts(trainer)
    loaded = {"model": detached_copies(model_state), "optim": detached_copies(optim_state["state"])}
    sharded.load(loaded, folder / TENSORS, int(meta["world_size"]))
    apply_model(trainer, loaded["model"])
    apply_optimizer(trainer, {"state": loaded["optim"], "param_groups": meta["param_groups"]})
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **meta["scheduler"]})
    trainer.data.position = int(meta["data_position"])
    if with_rng:
        rng.restore(read_json(rng_file(folder, trainer.rank), "generator state of this rank", SAVE_AGAIN), device_kind)
    hooks.after_load(dict(zip(trainer.names, trainer.params)))
    return meta
