"""What the ``formats`` scenario covers: the number formats, the quantization schemes, the run plan. torch-free.

A format is named by a short id (``e4m3fn``) in case ids and messages, by its torch attribute on
the device, by its ml_dtypes attribute in the oracle and by its safetensors dtype tag in files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    id: str  # in case ids and messages: e4m3fn
    torch_name: str  # attribute of torch
    oracle_name: str  # attribute of ml_dtypes
    tag: str  # safetensors dtype tag
    bits: int  # 8, or 4 for fp4 (two codes per byte, low nibble first, as torch.float4_e2m1fn_x2)
    counterpart: str | None = None  # the other vendor's flavour of the same layout (OCP fn vs AMD fnuz)

    @property
    def packed(self) -> bool:
        return self.bits < 8

    @property
    def code_count(self) -> int:
        return 1 << self.bits

    @property
    def fnuz(self) -> bool:
        """No negative zero and no infinity: 0x80 is the only NaN (AMD MI300's fp8)."""
        return self.id.endswith("fnuz")


FORMATS: dict[str, Format] = {f.id: f for f in (
    Format("e4m3fn", "float8_e4m3fn", "float8_e4m3fn", "F8_E4M3", 8, "e4m3fnuz"),
    Format("e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz", "F8_E4M3FNUZ", 8, "e4m3fn"),
    Format("e5m2", "float8_e5m2", "float8_e5m2", "F8_E5M2", 8, "e5m2fnuz"),
    Format("e5m2fnuz", "float8_e5m2fnuz", "float8_e5m2fnuz", "F8_E5M2FNUZ", 8, "e5m2"),
    Format("e8m0fnu", "float8_e8m0fnu", "float8_e8m0fnu", "F8_E8M0", 8),
    Format("e2m1fn", "float4_e2m1fn_x2", "float4_e2m1fn", "F4", 4),
)}
BY_TAG: dict[str, Format] = {f.tag: f for f in FORMATS.values()}


def format_named(name: str) -> Format | None:
    """A format by its id, torch name or ml_dtypes name (metadata uses the torch name); None if unknown."""
    return next((f for f in FORMATS.values() if name in (f.id, f.torch_name, f.oracle_name)), None)


@dataclass(frozen=True)
class Scheme:
    """How the tiny model's weights are quantized. ``block`` None: one float32 scale per tensor."""

    id: str
    element: str  # format id of the stored codes
    block: int | None = None  # MX: one e8m0 scale per ``block`` elements along the last dim
    source: str | None = None  # converted from this scheme's checkpoint instead of quantized
    what: str = ""

    @property
    def scale_format(self) -> str:
        return "float8_e8m0fnu" if self.block else "float32"


MX_BLOCK = 32  # the OCP MX v1.0 block size
SCHEMES: dict[str, Scheme] = {s.id: s for s in (
    Scheme("per_tensor_e4m3fn", "e4m3fn", what="per tensor to e4m3fn, scale amax/448 (NVIDIA, OCP)"),
    Scheme("per_tensor_e4m3fn_to_fnuz", "e4m3fnuz", source="per_tensor_e4m3fn",
           what="the e4m3fn checkpoint converted for MI300: 0x80 rewritten to 0x00, scales doubled"),
    Scheme("per_tensor_e4m3fnuz", "e4m3fnuz", what="per tensor to e4m3fnuz, scale amax/240 (MI300)"),
    Scheme("mx_fp8_e4m3fn", "e4m3fn", MX_BLOCK, what="MXFP8: blocks of 32 with e8m0 scales"),
    Scheme("mx_fp4_e2m1fn", "e2m1fn", MX_BLOCK, what="MXFP4: blocks of 32 with e8m0 scales"),
)}
# The e5m2 family goes through the io cases only, quantized by the oracle: a loader that hands e5m2 bytes back as
# e4m3fn (or e5m2fnuz as e5m2) needs such tensors in the files, not a quantized-<scheme> case of its own, and
# SCHEMES is part of the reference's config (adding to it would make every stored formats reference foreign).
IO_SCHEMES: dict[str, Scheme] = {s.id: s for s in (
    Scheme("per_tensor_e5m2", "e5m2", what="per tensor to e5m2, scale amax/57344 (OCP)"),
    Scheme("per_tensor_e5m2fnuz", "e5m2fnuz", what="per tensor to e5m2fnuz, scale amax/57344 (MI300)"),
)}

# Launch config keys that say what this session runs, not what the numbers depend on: the rank
# keeps them out of its record's config, so a reference recorded with another selection or
# --gpuregress-format-changes is not refused as foreign.
SESSION_ONLY = ("run", "format_changes")

# The stack's own checkpoint I/O every written file goes through, one ``io-<path>`` case each (stack_io.py).
IO_PATHS = ("safetensors", "safe_open", "torch_load", "dcp", "transformers")
