"""Quantized checkpoints as safetensors: the layout, a strict reader and a writer. torch-free.

Layout, one file per scheme:
  <name>          the codes, tagged with their format: F8_E4M3, F8_E4M3FNUZ, F8_E5M2, F4 ...
  <name>_scale    per tensor: an F32 scalar, value = decode(code) * scale;
                  MX: F8_E8M0 [rows, ceil(cols / block)], value = decode(code) * 2**(scale - 127)
  <name>_amax     per tensor: the F32 amax the scale was computed from, so a reader can check the scale
  metadata        quantization, element_format, scale_format, block_size, scale_rule, scheme

The file format (an 8-byte little-endian header length, a JSON header, raw bytes) is read and
written here rather than through the safetensors package because this codec is the independent
oracle: it reads the bytes the stack's writers produced and writes the files the stack's loaders
must read back exactly (stack_io.py, the ``io-*`` cases, test the stack's own I/O paths with it).
It also diagnoses files a given safetensors release cannot read (known_issues.py lists those
measured). The reader checks every offset and size, and never unpickles anything.
tests/test_formats_checkpoint.py reads the safetensors package's own files with it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ...reference import atomic
from . import oracle, quantize
from .catalog import BY_TAG, FORMATS, SCHEMES, Format, Scheme, format_named
from .errors import CheckpointProblem

LAYOUT = "gpuregress-quantized/1"
SCALE, AMAX = "_scale", "_amax"
SCALE_RULES = {"per_tensor": "amax/max", "mx": "ocp-mx-floor"}  # ocp-mx-floor: OCP MX v1.0 section 6.3
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
            raw = oracle.unpack_nibbles(raw)
        return raw.reshape(self.shape)

    def floats(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=FLOAT_TAGS[self.tag]).astype(np.float32).reshape(self.shape)


def stored_codes(name: str, fmt: Format, codes: np.ndarray) -> Stored:
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    data = oracle.pack_nibbles(codes.reshape(-1)) if fmt.packed else codes
    return Stored(name, fmt.tag, tuple(codes.shape), data.tobytes())


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
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointProblem(path, None, "__metadata__ must map names to strings", DAMAGED)
    data = blob[8 + size :]
    tensors = {name: _entry(path, name, entry, data) for name, entry in header.items()}
    covered = 0
    for begin, name in sorted((header[n]["data_offsets"][0], n) for n in tensors):
        if begin != covered:
            raise CheckpointProblem(path, name, f"data_offsets start at {begin}, where the previous tensor ends at "
                                    f"{covered}: tensors overlap or leave a gap", DAMAGED)
        covered = begin + len(tensors[name].data)
    if covered != len(data):
        raise CheckpointProblem(path, None, f"the tensors cover {covered} of the {len(data)} data bytes: the file "
                                "is truncated or has trailing bytes", DAMAGED)
    return Checkpoint(path, tensors, {str(k): v for k, v in metadata.items()})


def _entry(path: Path, name: str, entry: object, data: bytes) -> Stored:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointProblem(path, name, "its header entry needs dtype, shape and data_offsets", DAMAGED)
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if tag not in TAG_BITS:
        raise CheckpointProblem(path, name, f"unknown dtype tag {tag!r}; known: {', '.join(TAG_BITS)}", DAMAGED)
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(data)):
        raise CheckpointProblem(path, name, f"shape {shape!r} or data_offsets {offsets!r} is malformed or points past "
                                "the end of the file", DAMAGED)
    size = nbytes(tag, int(np.prod(shape, dtype=np.int64)))
    if size != offsets[1] - offsets[0]:
        raise CheckpointProblem(path, name, f"{tag} {shape} needs {size} bytes; its data_offsets hold "
                                f"{offsets[1] - offsets[0]}", DAMAGED)
    return Stored(name, tag, tuple(shape), bytes(data[offsets[0] : offsets[1]]))


# --- the quantized layout ---------------------------------------------------------------------


def metadata_for(scheme: Scheme) -> dict[str, str]:
    kind = "mx" if scheme.block else "per_tensor"
    meta = {"format": LAYOUT, "scheme": scheme.id, "quantization": kind,
            "element_format": FORMATS[scheme.element].torch_name, "scale_format": scheme.scale_format,
            "scale_rule": SCALE_RULES[kind]}
    if scheme.block:
        meta["block_size"] = str(scheme.block)
    if scheme.source:
        meta["converted_from"] = FORMATS[SCHEMES[scheme.source].element].torch_name
        meta["scale_rule"] = "converted: the source scale x 2"
    return meta


def quantized_tensors(name: str, fmt: Format, q: quantize.Quantized, block: int | None) -> list[Stored]:
    out = [stored_codes(name, fmt, q.codes)]
    out.append(stored_codes(name + SCALE, FORMATS["e8m0fnu"], q.scale) if block else stored_float32(name + SCALE, q.scale))
    if q.amax is not None:
        out.append(stored_float32(name + AMAX, q.amax))
    return out


@dataclass(frozen=True)
class Entry:
    """One quantized tensor of a file, with its scale, understood."""

    name: str
    tag: str
    fmt: Format
    codes: np.ndarray
    scale: np.ndarray  # float32 scalar (per tensor) or uint8 e8m0 codes [rows, blocks] (MX)
    block: int | None
    amax: float | None
    scale_rule: str | None

    def dequantize(self) -> np.ndarray:
        return quantize.dequantize(self.codes, self.scale, self.fmt, self.block)


def is_auxiliary(name: str) -> bool:
    return name.endswith((SCALE, AMAX, "_scale_inv"))


def entries(ckpt: Checkpoint) -> list[Entry]:
    """Every fp8/fp4 data tensor with its scale; CheckpointProblem for a missing scale or a tag that
    contradicts the metadata."""
    meta = ckpt.metadata
    element = _metadata_format(ckpt, "element_format")
    out = []
    for name, t in ckpt.tensors.items():
        fmt = BY_TAG.get(t.tag)
        if fmt is None or fmt.id == "e8m0fnu" or is_auxiliary(name):
            continue  # not quantized data (e8m0 only ever holds scales)
        if element is not None and element is not fmt:
            raise CheckpointProblem(ckpt.path, name, f"tagged {t.tag} ({fmt.torch_name}) but the metadata says "
                                    f"element_format {meta['element_format']}",
                                    f"export it again: the tag and the metadata must name the same format "
                                    f"(tag {element.tag} for {element.torch_name})")
        if fmt.packed and t.shape and t.shape[-1] % 2:
            raise CheckpointProblem(ckpt.path, name, f"F4 {list(t.shape)}: fp4 codes pack in pairs along the last "
                                    "dimension", "pad the last dimension to an even size")
        scale = ckpt.tensors.get(name + SCALE) or ckpt.tensors.get(name + "_scale_inv")
        if scale is None:
            raise CheckpointProblem(ckpt.path, name, f"no scale tensor: expected {name + SCALE} beside this "
                                    f"{t.tag} tensor", "write each scale with its codes; without it the codes "
                                    "cannot be dequantized")
        block, scale_values = _scale(ckpt, t, scale)
        amax = ckpt.tensors.get(name + AMAX)
        out.append(Entry(name, t.tag, fmt, t.codes(), scale_values, block,
                         float(amax.floats().reshape(-1)[0]) if amax is not None and amax.tag in FLOAT_TAGS else None,
                         meta.get("scale_rule")))
    return out


def _metadata_format(ckpt: Checkpoint, key: str) -> Format | None:
    name = ckpt.metadata.get(key)
    if name is None:
        return None
    fmt = format_named(name)
    if fmt is None:
        raise CheckpointProblem(ckpt.path, None, f"metadata {key} {name!r} names no format this reader knows "
                                f"({', '.join(f.torch_name for f in FORMATS.values())})", "fix the metadata")
    return fmt


SCALE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E8M0": "float8_e8m0fnu"}


def _scale(ckpt: Checkpoint, data: Stored, scale: Stored) -> tuple[int | None, np.ndarray]:
    """(block size or None, scale values) after checking the scale against the metadata and the data."""
    meta = ckpt.metadata
    if scale.tag not in SCALE_NAMES:
        raise CheckpointProblem(ckpt.path, scale.name, f"tagged {scale.tag}: a scale is a float scalar (per tensor) "
                                "or F8_E8M0 block scales (MX)", "store the scale as F32")
    mx = scale.tag == "F8_E8M0"
    declared = meta.get("scale_format")
    if (declared is not None and declared != SCALE_NAMES[scale.tag]) or meta.get("quantization") == ("per_tensor" if mx else "mx"):
        raise CheckpointProblem(ckpt.path, scale.name, f"tagged {scale.tag} ({SCALE_NAMES[scale.tag]}) but the metadata "
                                f"says quantization {meta.get('quantization')}, scale_format {declared}",
                                "export it again: the scale tags and the metadata must agree")
    if not mx:
        if scale.count != 1:
            raise CheckpointProblem(ckpt.path, scale.name, f"{scale.tag} {list(scale.shape)}: this reader takes one "
                                    "float scale per tensor, or F8_E8M0 block scales", "store one scale per tensor")
        return None, scale.floats().reshape(())
    try:
        block = int(meta["block_size"])
    except (KeyError, ValueError):
        raise CheckpointProblem(ckpt.path, scale.name, "F8_E8M0 block scales, but the metadata gives no integer "
                                "block_size", "add block_size (32 for OCP MX) to the metadata") from None
    rows, cols = (data.shape[:-1], data.shape[-1]) if data.shape else ((), 1)
    expected = (*rows, -(-cols // block))
    if scale.shape != expected:
        raise CheckpointProblem(ckpt.path, scale.name, f"shape {list(scale.shape)}; blocks of {block} over "
                                f"{data.name} {list(data.shape)} need {list(expected)}",
                                "export it again: one e8m0 scale per block along the last dimension")
    return block, scale.codes()
