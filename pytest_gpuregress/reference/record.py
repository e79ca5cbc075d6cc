"""RunRecord: what one scenario run produced, in a torch-free form: JSON plus one safetensors file.

The same two files are what a worker hands back and what the store keeps, so there is one serializer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptReference
from . import atomic

RECORD_FORMAT = "gpuregress-record/2"
# An older format is refused, never read with fallbacks: the plugin is unreleased, so no user holds one.
RERECORD = ("re-record it with this version of pytest-gpuregress, on a known-good stack: "
            "pytest --gpuregress --gpuregress-record --gpuregress-reference-dir <this folder's root>")
RECORD_JSON = "record.json"
TENSORS_FILE = "tensors.safetensors"


@dataclass
class RunRecord:
    """Results of one scenario run: per-step ``series`` (float64), named numpy ``arrays``, final-weight ``digests``,
    JSON ``results``, and ``attachments`` (folders such as ``resume`` the store keeps beside the two files)."""

    scenario: str
    config: dict[str, Any]
    platform_key: str
    world_size: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)
    param_names: list[str] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    attachments: dict[str, Path] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.series.get("loss", []))

    def to_json(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, **{key: read(getattr(self, key)) for key, read in _JSON_FIELDS.items()}}

    def save(self, directory: Path) -> list[Path]:
        """Write record.json and tensors.safetensors into ``directory``; return the paths."""
        from safetensors.numpy import save

        directory.mkdir(parents=True, exist_ok=True)
        json_path = directory / RECORD_JSON
        atomic.write_json(json_path, self.to_json())
        tensor_path = directory / TENSORS_FILE
        arrays = {k: np.ascontiguousarray(v) for k, v in self.arrays.items()}
        atomic.write_bytes(tensor_path, save(arrays, metadata={"format": RECORD_FORMAT}))
        return [json_path, tensor_path]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        """The inverse of ``to_json`` (without arrays); only ``_REQUIRED`` fields must be there. Raises KeyError,
        TypeError or ValueError."""
        return cls(**{key: read(data[key]) for key, read in _JSON_FIELDS.items() if key in data or key in _REQUIRED})

    @classmethod
    def load(cls, directory: Path) -> RunRecord:
        """Read a record; raise CorruptReference naming the file on any parse problem."""
        json_path = directory / RECORD_JSON
        tensor_path = directory / TENSORS_FILE
        data = read_json(json_path)
        found = other_format(data)
        if found is not None:
            raise CorruptReference(json_path, f"format is {found!r}, expected {RECORD_FORMAT!r}", RERECORD)
        try:
            record = cls.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptReference(json_path, f"missing or malformed field: {exc!r}",
                                   "re-record it (--gpuregress-record)") from exc
        record.arrays = _read_tensors(tensor_path)
        return record


def _float_series(series: dict[str, Any]) -> dict[str, list[float]]:
    return {k: [float(x) for x in v] for k, v in series.items()}


# record.json's fields besides "format", each with what reads it back (and writes it: the same conversion).
_JSON_FIELDS: dict[str, Callable[[Any], Any]] = {
    "scenario": str, "config": dict, "platform_key": str, "world_size": int, "fingerprint": dict,
    "series": _float_series, "param_names": list, "digests": dict, "timings": dict, "results": dict, "notes": list,
}
_REQUIRED = ("scenario", "config", "platform_key", "world_size")  # the others default to empty when absent


def other_format(data: dict[str, Any]) -> str | None:
    """The format a record.json's ``data`` names where it is not the one this version reads; None where it is."""
    found = data.get("format")
    return None if found == RECORD_FORMAT else str(found)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CorruptReference(path, "file is missing", "re-record it (--gpuregress-record)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptReference(path, f"not valid JSON ({exc})", "restore it from git or re-record it") from exc
    if not isinstance(data, dict):
        raise CorruptReference(path, "top level is not a JSON object", "restore it from git or re-record it")
    return data


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    # safetensors never executes code from the file: this is why references are not pickles.
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise CorruptReference(path, "file is missing", "re-record it (--gpuregress-record)")
    try:
        return dict(load_file(str(path)))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptReference(path, f"not a readable safetensors file ({exc})",
                               "restore it from git or re-record it") from exc


def float_digest(values: np.ndarray) -> dict[str, Any]:
    """sha256 of the raw bytes, plus float64 sums a tolerant comparison reads: ``sum`` and ``abs_sum`` the
    magnitude; ``signed_dot`` (w[i] times a fixed +-1 pattern) moves when signs flip or elements swap."""
    flat = np.ascontiguousarray(values)
    as64 = flat.astype(np.float64)
    index = np.arange(as64.size, dtype=np.uint64)
    with np.errstate(over="ignore"):  # a multiplicative hash, wrapping mod 2**64 by design
        pattern = 1.0 - 2.0 * ((index * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(63)).astype(np.float64)
    return {
        "sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
        "sum": float(as64.sum()),
        "abs_sum": float(np.abs(as64).sum()),
        "l2": float(np.sqrt((as64 * as64).sum())),
        "signed_dot": float(as64.reshape(-1) @ pattern),
        "shape": list(flat.shape),
        "dtype": str(flat.dtype),
    }
