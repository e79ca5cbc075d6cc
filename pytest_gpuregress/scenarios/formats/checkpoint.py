"""Quantized checkpoints as safetensors: the layout, a strict reader and a writer. torch-free.

The file format goes through the plugin's own strict codec (scenarios/shared/safetensors_file.py), not the
safetensors package, because it is the independent oracle for the stack's own I/O (stack_io.py) and must read
files some safetensors releases cannot. It never unpickles. The layout: docs/formats.md, "gpuregress inspect-fp8".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import CheckpointProblem
from ..shared.safetensors_file import FLOAT_TAGS, Checkpoint, Stored, pack_nibbles, stored_float32
from ..shared.safetensors_file import read as read  # the formats code reads and writes files through this module
from ..shared.safetensors_file import write as write
from . import quantize
from .catalog import BY_TAG, FORMATS, SCHEMES, Format, Scheme, format_named

LAYOUT = "gpuregress-quantized/1"
SCALE, AMAX = "_scale", "_amax"
SCALE_RULES = {"per_tensor": "amax/max", "mx": "ocp-mx-floor"}  # ocp-mx-floor: OCP MX v1.0 section 6.3


def stored_codes(name: str, fmt: Format, codes: np.ndarray) -> Stored:
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    data = pack_nibbles(codes.reshape(-1)) if fmt.packed else codes
    return Stored(name, fmt.tag, tuple(codes.shape), data.tobytes())


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


def entries(ckpt: Checkpoint) -> list[Entry]:
    """Every fp8/fp4 data tensor with its scale; CheckpointProblem for a missing scale or a tag that
    contradicts the metadata."""
    meta = ckpt.metadata
    element = _metadata_format(ckpt, "element_format")
    out = []
    for name, t in ckpt.tensors.items():
        fmt = BY_TAG.get(t.tag)
        if fmt is None or fmt.id == "e8m0fnu" or name.endswith((SCALE, AMAX, "_scale_inv")):
            continue  # not quantized data (e8m0 only ever holds scales)
        _check_data(ckpt, name, t, fmt, element)
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


def _check_data(ckpt: Checkpoint, name: str, t: Stored, fmt: Format, element: Format | None) -> None:
    """CheckpointProblem where the data tensor's tag contradicts the metadata's element_format, or fp4 codes
    cannot pair up along the last dimension."""
    if element is not None and element is not fmt:
        raise CheckpointProblem(ckpt.path, name, f"tagged {t.tag} ({fmt.torch_name}) but the metadata says "
                                f"element_format {ckpt.metadata['element_format']}",
                                f"export it again: the tag and the metadata must name the same format "
                                f"(tag {element.tag} for {element.torch_name})")
    if fmt.packed and t.shape and t.shape[-1] % 2:
        raise CheckpointProblem(ckpt.path, name, f"F4 {list(t.shape)}: fp4 codes pack in pairs along the last "
                                "dimension", "pad the last dimension to an even size")


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
    block = _block_size(ckpt, data, scale)
    return block, scale.codes()


def _block_size(ckpt: Checkpoint, data: Stored, scale: Stored) -> int:
    """The metadata's MX block size, checked against the shapes of the data and its block scales."""
    try:
        block = int(ckpt.metadata["block_size"])
    except (KeyError, ValueError):
        raise CheckpointProblem(ckpt.path, scale.name, "F8_E8M0 block scales, but the metadata gives no integer "
                                "block_size", "add block_size (32 for OCP MX) to the metadata") from None
    rows, cols = (data.shape[:-1], data.shape[-1]) if data.shape else ((), 1)
    expected = (*rows, -(-cols // block))
    if scale.shape != expected:
        raise CheckpointProblem(ckpt.path, scale.name, f"shape {list(scale.shape)}; blocks of {block} over "
                                f"{data.name} {list(data.shape)} need {list(expected)}",
                                "export it again: one e8m0 scale per block along the last dimension")
    return block
