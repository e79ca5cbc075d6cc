"""Safetensors files, read and written by the plugin's own strict codec. torch-free.

Not the safetensors package, so the plugin holds an independent reader: it checks every header entry, offset
and size, names the file and tensor of each problem, and never unpickles. The formats and checkpoint
scenarios both read with it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ...errors import CheckpointProblem
from ...reference import atomic

HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header
TAG_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8, "F8_E5M2FNUZ": 8,
            "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
            "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}
FLOAT_TAGS = {"F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}
DAMAGED = "the file is damaged or was written wrongly: export it again"
NOT_SAFETENSORS = "check the path; this reader takes safetensors only and never unpickles (.bin and .pt files are pickles)"


@dataclass(frozen=True)
class Stored:
    """One tensor of a file: its tag, logical shape (fp4: elements, not bytes) and raw bytes."""

    name: str
    tag: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def codes(self) -> np.ndarray:
        """uint8 codes, one per element (fp4 unpacked, low nibble first), in the logical shape."""
        raw = np.frombuffer(self.data, dtype=np.uint8)
        if self.tag == "F4":
            raw = unpack_nibbles(raw)
        return raw.reshape(self.shape)

    def floats(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=FLOAT_TAGS[self.tag]).astype(np.float32).reshape(self.shape)


def stored_float32(name: str, values: np.ndarray) -> Stored:
    array = np.ascontiguousarray(values, dtype="<f4")
    return Stored(name, "F32", tuple(array.shape), array.tobytes())


def nbytes(tag: str, count: int) -> int | None:
    """Bytes of ``count`` elements of ``tag``; None when they do not fill whole bytes."""
    bits = TAG_BITS[tag] * count
    return bits // 8 if bits % 8 == 0 else None


def to_bytes(tensors: list[Stored], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.tag, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    return struct.pack("<Q", len(text)) + text + b"".join(t.data for t in tensors)


def write(path: Path, tensors: list[Stored], metadata: dict[str, str]) -> None:
    atomic.write_bytes(path, to_bytes(tensors, metadata))


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, Stored]
    metadata: dict[str, str]


def read(path: Path) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointProblem(path, None, "no such file", "check the path")
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise CheckpointProblem(path, None, f"cannot be read ({exc.strerror})", "check its permissions") from None
    return parse(blob, path)


def parse(blob: bytes, path: Path) -> Checkpoint:
    """Validate and split a safetensors file; every problem names the file and, where known, the tensor."""
    header, size = _header(blob, path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointProblem(path, None, "__metadata__ must map names to strings", DAMAGED)
    data = blob[8 + size :]
    tensors = {name: _entry(path, name, entry, data) for name, entry in header.items()}
    _check_coverage(path, header, tensors, len(data))
    return Checkpoint(path, tensors, {str(k): v for k, v in metadata.items()})


def _header(blob: bytes, path: Path) -> tuple[dict[str, Any], int]:
    """The file's JSON header and its length in bytes, or CheckpointProblem where the file is no safetensors."""
    if len(blob) < 8:
        raise CheckpointProblem(path, None, f"not a safetensors file: {len(blob)} bytes, shorter than the 8-byte "
                                "header length", NOT_SAFETENSORS)
    (size,) = struct.unpack("<Q", blob[:8])
    if size > HEADER_LIMIT or 8 + size > len(blob):
        raise CheckpointProblem(path, None, f"not a safetensors file: its first 8 bytes announce a header of {size} "
                                f"bytes, and the file has {len(blob)}", NOT_SAFETENSORS)
    try:
        header = json.loads(blob[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointProblem(path, None, f"not a safetensors file: the header is not JSON ({exc})",
                                NOT_SAFETENSORS) from None
    if not isinstance(header, dict):
        raise CheckpointProblem(path, None, "not a safetensors file: the header is not a JSON object", NOT_SAFETENSORS)
    return header, size


def _check_coverage(path: Path, header: dict[str, Any], tensors: dict[str, Stored], data_size: int) -> None:
    """The tensors' bytes follow one another with no overlap or gap and cover the data exactly."""
    covered = 0
    for begin, name in sorted((header[n]["data_offsets"][0], n) for n in tensors):
        if begin != covered:
            raise CheckpointProblem(path, name, f"data_offsets start at {begin}, where the previous tensor ends at "
                                    f"{covered}: tensors overlap or leave a gap", DAMAGED)
        covered = begin + len(tensors[name].data)
    if covered != data_size:
        raise CheckpointProblem(path, None, f"the tensors cover {covered} of the {data_size} data bytes: the file "
                                "is truncated or has trailing bytes", DAMAGED)


def _well_formed(shape: object, offsets: object, data_size: int) -> bool:
    """A shape of non-negative ints, and two int data_offsets in order within the data."""
    return (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size)


def _entry(path: Path, name: str, entry: object, data: bytes) -> Stored:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointProblem(path, name, "its header entry needs dtype, shape and data_offsets", DAMAGED)
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if tag not in TAG_BITS:
        raise CheckpointProblem(path, name, f"unknown dtype tag {tag!r}; known: {', '.join(TAG_BITS)}", DAMAGED)
    if not _well_formed(shape, offsets, len(data)):
        raise CheckpointProblem(path, name, f"shape {shape!r} or data_offsets {offsets!r} is malformed or points past "
                                "the end of the file", DAMAGED)
    size = nbytes(tag, int(np.prod(shape, dtype=np.int64)))
    if size != offsets[1] - offsets[0]:
        raise CheckpointProblem(path, name, f"{tag} {shape} needs {size} bytes; its data_offsets hold "
                                f"{offsets[1] - offsets[0]}", DAMAGED)
    return Stored(name, tag, tuple(shape), bytes(data[offsets[0] : offsets[1]]))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Packed fp4 bytes to one code per element: element 2i in the low nibble of byte i."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 codes pack in pairs along the last dimension; it has {codes.shape[-1]}")
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)
