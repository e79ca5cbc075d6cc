"""On the device: the casts, decodes and quantization steps that the checks exercise. Rank side.

``@fault_point`` functions are where faults/formats.py acts. torch 2.13 has no fp4 cast ('"copy_kernel" not
implemented for Float4_e2m1fn_x2', measured), so fp4 goes through the torch-op codec below, checked against
the oracle like torch's own casts.
"""

from __future__ import annotations

import math

import torch

from ...fault_points import fault_point
from .catalog import FORMATS, Format

E8M0_BIAS = 127
E8M0 = FORMATS["e8m0fnu"]
FP4_CODES = 16


def missing(fmt: Format) -> str | None:
    """Why ``fmt`` cannot be checked with this torch, or None when it can."""
    return None if hasattr(torch, fmt.torch_name) else f"torch {torch.__version__} has no torch.{fmt.torch_name}"


def torch_dtype(fmt: Format) -> torch.dtype:
    why = missing(fmt)
    if why:
        raise RuntimeError(why)
    return getattr(torch, fmt.torch_name)


def native_fp4_cast() -> bool:
    """Whether torch can cast to float4_e2m1fn_x2 itself (reported; the codec below is used either way)."""
    try:
        torch.zeros(2).to(torch.float4_e2m1fn_x2)
    except (RuntimeError, AttributeError, TypeError):
        return False
    return True


@fault_point("formats.decode")
def decode(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float32 values of uint8 ``codes`` (one per element) read as ``fmt``: how the device reads bytes."""
    if fmt.packed:
        return fp4_decode(codes)
    return codes.view(torch_dtype(fmt)).to(torch.float32)


@fault_point("formats.cast")
def cast(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """uint8 codes of float32 ``values`` cast to ``fmt`` on the device (torch's conversion)."""
    if fmt.packed:
        return fp4_encode(values)
    return values.to(torch_dtype(fmt)).view(torch.uint8)


@fault_point("formats.format_max")
def format_max(fmt: Format) -> float:
    """The largest finite value, as a quantizer asks torch for it."""
    if fmt.packed:
        return float(fp4_decode(torch.tensor([FP4_CODES // 2 - 1], dtype=torch.uint8))[0])
    return float(torch.finfo(torch_dtype(fmt)).max)


@fault_point("formats.fn_to_fnuz")
def fn_to_fnuz(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes and scale to e4m3fnuz, as ROCm loaders convert checkpoints (vLLM's
    normalize_e4m3fn_to_e4m3fnuz): the same bytes read as fnuz are worth half, so the scale doubles;
    0x80 is e4m3fn's negative zero but e4m3fnuz's NaN, so it becomes 0x00."""
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes), scale * 2


@fault_point("formats.mx_scale_exponent")
def mx_scale_exponent(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """OCP MX v1.0 section 6.3: floor(log2(amax)) - emax of the element format; 2**-127 for zero blocks.
    frexp is exact where log2 need not be correctly rounded on a GPU."""
    emax = math.frexp(format_max(fmt))[1] - 1
    _, exponent = torch.frexp(amax)
    shared = (exponent - 1 - emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.ldexp(1 + mantissa / 2, exponent - 1))
    return torch.where((c >> 3) & 1 == 1, -magnitude, magnitude)


def fp4_encode(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to the even code, saturating at ±6 (fp4 has neither inf nor NaN)."""
    magnitudes = fp4_decode(torch.arange(FP4_CODES // 2, dtype=torch.uint8, device=values.device))
    ties = (magnitudes[1:] + magnitudes[:-1]) / 2
    size = values.abs()
    code = torch.bucketize(size, ties)  # a value equal to a tie gets the lower code
    on_tie = (code < ties.numel()) & (size == ties[code.clamp(max=ties.numel() - 1)])
    code = code + (on_tie & (code % 2 == 1)).to(code.dtype)
    return (code | (torch.signbit(values).to(code.dtype) << 3)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 to one uint8 code per element: element 2i in the low nibble of byte i."""
    raw = packed.view(torch.uint8)
    return torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)

