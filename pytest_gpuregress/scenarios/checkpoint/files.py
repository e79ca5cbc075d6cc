"""Reading a model checkpoint a user points to: safetensors only, strictly, torch-free.

A file, a folder (transformers' layouts, sharded or not) or a checkpoint-scenario reference folder; each file
goes through the strict reader (shared/safetensors_file.py), so a truncated shard is one error naming the file.
Nothing is ever unpickled: ``.bin``, ``.pt`` and ``.pth`` files are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ...errors import CheckpointProblem
from ..shared import safetensors_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BUNDLE_PREFIX = "checkpoint/"  # where the checkpoint scenario's reference keeps the trained model
BUNDLE_TENSORS = "tensors.safetensors"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass
class CheckpointFiles:
    """The tensors of a checkpoint, with the file each came from and its safetensors dtype tag."""

    path: Path  # what the user gave
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    origin: dict[str, Path] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    prefix: str = ""  # before every name in the files (a bundle's ``checkpoint/``): a loader strips it

    def file_of(self, name: str) -> Path:
        return self.origin.get(name, self.path)


def as_array(stored: safetensors_file.Stored, path: Path) -> np.ndarray:
    dtype = NUMPY_DTYPES.get(stored.tag)
    if dtype is None:
        raise CheckpointProblem(path, stored.name, f"dtype {stored.tag}: not a plain weight dtype ({', '.join(NUMPY_DTYPES)})",
                                "dequantize fp8/fp4 checkpoints first (gpuregress inspect-fp8 checks them)")
    return np.frombuffer(stored.data, dtype=dtype).reshape(stored.shape).copy()


def _add(out: CheckpointFiles, path: Path, prefix: str = "") -> None:
    ckpt = safetensors_file.read(path)
    for name, stored in ckpt.tensors.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):]
        if key in out.tensors:
            raise CheckpointProblem(path, key, f"also stored in {out.origin[key].name}: a tensor must be in one shard",
                                    "export the checkpoint again")
        out.tensors[key] = as_array(stored, path)
        out.tags[key] = stored.tag
        out.origin[key] = path
    out.metadata.update(ckpt.metadata)


def _shards_of(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointProblem(index, None, f"not a safetensors index (needs a weight_map object: {exc!r})",
                                "export the checkpoint again") from None
    for name in files:
        if not (index.parent / name).is_file():
            listed = sum(1 for f in weight_map.values() if f == name)
            raise CheckpointProblem(index.parent / name, None, f"missing: the index lists {listed} tensors in this shard",
                                    "copy every shard the index names into the folder")
    return [index.parent / name for name in files]


def _files_of(path: Path) -> tuple[list[Path], str]:
    """The safetensors files of the checkpoint at ``path`` and the prefix of its names: one file, a bundle, an
    index's shards, model.safetensors, or a folder's shards; CheckpointProblem for a pickle or nothing to read."""
    if path.is_file():
        if path.suffix in PICKLES:
            raise CheckpointProblem(path, None, "a pickle: this tool never unpickles (loading it could run code)",
                                    "convert it to safetensors on a machine you trust, then pass the .safetensors file")
        return [path], ""
    if (path / BUNDLE_TENSORS).is_file() and (path / "record.json").is_file():
        return [path / BUNDLE_TENSORS], BUNDLE_PREFIX
    if (path / INDEX).is_file():
        return _shards_of(path / INDEX), ""
    if (path / SINGLE).is_file():
        return [path / SINGLE], ""
    if shards := sorted(path.glob("*.safetensors")):  # empty for a file or a missing path
        return shards, ""
    what = "no such file or folder" if not path.exists() else "no .safetensors file in this folder"
    raise CheckpointProblem(path, None, what, "pass a .safetensors file, or a folder holding model.safetensors "
                            "or the shards of model.safetensors.index.json")


def read(path: Path) -> CheckpointFiles:
    """The checkpoint at ``path``; CheckpointProblem naming the file and the fix when it cannot be read."""
    path = Path(path)
    files, prefix = _files_of(path)
    out = CheckpointFiles(path, prefix=prefix)
    for file in files:
        _add(out, file, prefix)
    if not out.tensors:
        raise CheckpointProblem(path, None, "holds no tensors", "check the path: this is not a model checkpoint")
    return out
