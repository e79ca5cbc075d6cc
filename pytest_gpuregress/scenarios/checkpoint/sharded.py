"""Rank side: sharded checkpoints with torch.distributed.checkpoint (DCP), its default filesystem format.

Saved to a staging folder swapped in whole, so a reader sees a complete checkpoint or none. Only tensors go to
DCP (it would torch.save anything else); DCP's own ``.metadata`` is a pickle, so this reads only checkpoints its
ranks just wrote in its own temporary folder, never one a user points to. ``save`` and ``load`` are fault points.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import CheckpointProblem
from ...fault_points import fault_point
from ...reference import atomic
from ...training.dcp_safetensors import refused_as_problem, tensors_only

METADATA = ".metadata"


@fault_point("checkpoint.sharded_save")
def save(state: dict[str, Any], folder: Path) -> None:
    """Save ``state`` (nested dicts of tensors and DTensors) into ``folder``. Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tensors_only(state)
    staged = folder.with_name(f".{folder.name}.staging")  # named after ``folder``: the same on every rank
    dcp.save(state, checkpoint_id=str(staged))
    dist.barrier()  # every shard is written before the folder becomes visible
    if dist.get_rank() == 0:
        atomic.replace_dir(staged, folder)
    dist.barrier()


@fault_point("checkpoint.sharded_load")
def load(state: dict[str, Any], folder: Path, saved_world: int) -> None:
    """Fill ``state``'s tensors in place from ``folder``, at this run's world size. Collective.

    ``saved_world``: the world size that wrote the folder (a fault uses it to permute chunks)."""
    import torch.distributed.checkpoint as dcp

    tensors_only(state)
    verify(folder)
    with refused_as_problem(folder, "this run wrote it: the stack's save and load disagree (a checkpoint bug)"):
        dcp.load(state, checkpoint_id=str(folder))


def verify(folder: Path) -> None:
    """Every file the metadata lists is there and long enough; a clear error naming the file otherwise."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / METADATA).is_file():
        raise CheckpointProblem(folder, None, f"no {METADATA}: not a complete DCP checkpoint",
                                "the save did not finish; save it again")
    metadata = FileSystemReader(str(folder)).read_metadata()  # a pickle: only from this run's own folders
    needs: dict[str, int] = {}
    holds: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), int(info.offset) + int(info.length))
        holds.setdefault(info.relative_path, []).append(index.fqn)
    for name, size in sorted(needs.items()):
        path = folder / name
        keys = sorted(set(holds[name]))
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        if not path.is_file():
            raise CheckpointProblem(path, None, f"missing: the metadata lists chunks of {len(keys)} tensors in this "
                                    f"shard ({shown}), and no rank wrote it here",
                                    "every rank must write its shard into the same folder (shared storage); save again")
        actual = os.path.getsize(path)
        if actual < size:
            raise CheckpointProblem(path, None, f"truncated: {actual} bytes, its chunks ({shown}) need {size}",
                                    "the save did not finish or the copy was cut short; save or copy it again")
