"""Rank side: torch.distributed.checkpoint (DCP) with torch's own safetensors storage, so nothing is pickled.

DCP's default format pickles its metadata; a checkpoint shipped inside a reference uses the HuggingFace
storage writer and reader instead (docs/checkpoint.md). Only tensors are handed to DCP (``tensors_only``).
Torch is imported inside the functions, but ``unavailable`` may run anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import CheckpointProblem

SUFFIX = ".safetensors"


def unavailable() -> str | None:
    """Why this torch cannot write or read a DCP checkpoint in safetensors; None when it can."""
    import torch
    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "HuggingFaceStorageWriter") or not hasattr(dcp, "HuggingFaceStorageReader"):
        return (f"torch {torch.__version__} has no torch.distributed.checkpoint.HuggingFaceStorageWriter/Reader "
                "(DCP in safetensors), and a checkpoint shipped in a reference is never read as a pickle")
    return None


def tensors_only(state: dict[str, Any], where: str = "") -> None:
    """Refuse anything but tensors: DCP would pickle it."""
    import torch

    for key, value in state.items():
        if isinstance(value, dict):
            tensors_only(value, f"{where}{key}.")
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}{key} is a {type(value).__name__}: only tensors go to DCP (anything else is pickled)")


def save(state: dict[str, Any], folder: Path) -> None:
    """Every rank writes its shards of ``state`` (nested dicts of tensors and DTensors) into ``folder``. Collective."""
    import torch.distributed.checkpoint as dcp

    tensors_only(state)
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load(state: dict[str, Any], folder: Path) -> None:
    """Fill ``state``'s tensors in place from the shards in ``folder``, at this run's world size. Collective."""
    import torch.distributed.checkpoint as dcp

    tensors_only(state)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))


@contextmanager
def refused_as_problem(folder: Path, fix: str) -> Iterator[None]:
    """DCP's refusal to load (CheckpointException, a BaseException that a caller's ``except Exception`` misses) as a
    CheckpointProblem naming ``folder`` and the first failing rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise CheckpointProblem(folder, None, f"DCP cannot load it: {_rank_error(exc)}", fix) from None


def _rank_error(exc: BaseException) -> str:
    """DCP's CheckpointException told by the first failing rank's own error, which says what failed ("rank 0:
    RuntimeError: Missing key in checkpoint state_dict: ...")."""
    failures = getattr(exc, "failures", None) or {}
    if not failures:
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__
    rank, failure = min(failures.items())
    inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
    lines = str(inner).strip().splitlines()
    return f"rank {rank}: {type(inner).__name__}: {lines[0] if lines else ''}"


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files DCP's reader would read in ``folder``."""
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX)) if folder.is_dir() else []
