"""The independent oracle: ml_dtypes, the numpy dtype library maintained with JAX. torch-free.

Every decode and round-to-nearest-even encode is ml_dtypes'; nothing is hand-written but the fp4 nibble
packing (the file codec's). tests/scenarios/formats/test_formats_oracle.py pins OCP spec codes, so the oracle is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import ml_dtypes
import numpy as np

from ..shared.safetensors_file import pack_nibbles as pack_nibbles
from ..shared.safetensors_file import unpack_nibbles as unpack_nibbles
from .catalog import FORMATS, Format


@dataclass(frozen=True)
class Limits:
    max: float  # largest finite value
    smallest_normal: float
    smallest_subnormal: float  # == smallest_normal when the format has no subnormals (e8m0)
    emax: int  # exponent of the largest binade: max = m * 2**emax with 1 <= m < 2 (OCP MX's emax_elem)
    mantissa_bits: int


def dtype(fmt: Format) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, fmt.oracle_name))


@cache
def limits(fmt: Format) -> Limits:
    info = ml_dtypes.finfo(dtype(fmt))
    return Limits(float(info.max), float(info.smallest_normal), float(info.smallest_subnormal),
                  int(info.maxexp) - 1, int(info.nmant))


def all_codes(fmt: Format) -> np.ndarray:
    return np.arange(fmt.code_count, dtype=np.uint8)


def decode(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """float32 values of ``codes`` (uint8, one code per element; fp4 codes in the low nibble)."""
    raw = np.ascontiguousarray(codes, dtype=np.uint8)
    if fmt.packed:
        raw = raw & np.uint8(fmt.code_count - 1)
    return raw.view(dtype(fmt)).astype(np.float32)


def encode(values: np.ndarray, fmt: Format) -> np.ndarray:
    """Round-to-nearest-even codes of float32 ``values``, as uint8 (OCP's non-saturating conversion:
    overflow gives NaN or inf where the format has them; fp4 has neither and saturates)."""
    return np.ascontiguousarray(values, dtype=np.float32).astype(dtype(fmt)).view(np.uint8)


def same_values(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: the same float32 bits (so -0.0 differs from 0.0), or both NaN. NaN payloads and
    the sign of a NaN are not part of either spec, so they are not compared."""
    a32, b32 = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return (a32.view(np.uint32) == b32.view(np.uint32)) | (np.isnan(a32) & np.isnan(b32))


def same_codes(a: np.ndarray, b: np.ndarray, fmt: Format) -> np.ndarray:
    """Elementwise: codes that decode to the same value in ``fmt`` (e4m3fn's 0x7F and 0xFF are both NaN)."""
    return same_values(decode(a, fmt), decode(b, fmt))


def identify(codes: np.ndarray, values: np.ndarray, fmt: Format) -> Format | None:
    """Which other format of the same width decodes ``codes`` to exactly ``values``: what the device
    read them as, when it disagrees with ``fmt``."""
    return next((other for other in FORMATS.values() if other is not fmt and other.bits == fmt.bits
                 and same_values(decode(codes, other), values).all()), None)


def as_float64(values: np.ndarray) -> np.ndarray:
    """Widen without a warning: a device can hand back signalling NaNs, which raise 'invalid' in a cast."""
    with np.errstate(invalid="ignore"):
        return np.asarray(values, dtype=np.float64)


def value_ratio(expected: np.ndarray, got: np.ndarray) -> float | None:
    """got / expected where both are finite and non-zero, when that ratio is one number; else None."""
    e, g = as_float64(expected), as_float64(got)
    usable = np.isfinite(e) & np.isfinite(g) & (e != 0) & (g != 0)
    if not usable.any():
        return None
    ratios = g[usable] / e[usable]
    return float(ratios[0]) if np.all(ratios == ratios[0]) else None
