"""The oracle's quantizers: per tensor, MX blocks, and the e4m3fn -> e4m3fnuz conversion. torch-free.

The rules device.py must reproduce bit for bit. Every step is exactly specified (exact amax, one correctly
rounded division, power-of-two MX scales, round-to-nearest-even), so a difference is a bug, not noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import oracle
from .catalog import FORMATS, SCHEMES, Format, Scheme

E8M0_BIAS = 127


@dataclass
class Quantized:
    """One tensor's codes (one per element, uint8) and its scales. Per tensor: ``scale`` is a float32 scalar, value =
    decode(code) * scale; ``amax`` is what it was computed from. MX: ``scale`` holds e8m0 codes [rows, blocks],
    value = decode(code) * 2**(scale - 127)."""

    codes: np.ndarray
    scale: np.ndarray
    amax: np.ndarray | None = None


def per_tensor(w: np.ndarray, fmt: Format) -> Quantized:
    w = np.asarray(w, dtype=np.float32)
    top = np.float32(oracle.limits(fmt).max)
    amax = np.float32(np.abs(w).max()) if w.size else np.float32(0)
    scale = amax / top if amax > 0 else np.float32(1)  # an all-zero tensor keeps scale 1
    codes = oracle.encode(np.clip(w / scale, -top, top), fmt)
    return Quantized(codes, np.asarray(scale, dtype=np.float32), np.asarray(amax, dtype=np.float32))


def mx_exponents(amax: np.ndarray, fmt: Format) -> np.ndarray:
    """OCP MX v1.0 section 6.3: shared exponent floor(log2(amax)) - emax of the element format.
    frexp gives it exactly (log2 need not be correctly rounded); an all-zero block gets 2**-127."""
    _, exponent = np.frexp(np.asarray(amax, dtype=np.float32))
    shared = exponent.astype(np.int64) - 1 - oracle.limits(fmt).emax
    return np.where(amax > 0, np.clip(shared, -E8M0_BIAS, E8M0_BIAS), -E8M0_BIAS)


def blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[rows, cols] -> [rows, ceil(cols/block), block], the last block padded with zeros."""
    rows, cols = w.shape
    padded = np.zeros((rows, -(-cols // block) * block), dtype=np.float32)
    padded[:, :cols] = w
    return padded.reshape(rows, -1, block)


def mx(w: np.ndarray, fmt: Format, block: int) -> Quantized:
    w = np.asarray(w, dtype=np.float32)
    grouped = blocks(w, block)
    shared = mx_exponents(np.abs(grouped).max(axis=-1), fmt)
    top = np.float32(oracle.limits(fmt).max)
    scaled = np.clip(np.ldexp(grouped, -shared[..., None]).astype(np.float32), -top, top)  # OCP: saturate
    codes = oracle.encode(scaled, fmt).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return Quantized(codes, (shared + E8M0_BIAS).astype(np.uint8))


def quantize(w: np.ndarray, scheme: Scheme) -> Quantized:
    fmt = FORMATS[scheme.element]
    if scheme.source:
        source = SCHEMES[scheme.source]
        return fn_to_fnuz(quantize(w, source), FORMATS[source.element], fmt)
    return mx(w, fmt, scheme.block) if scheme.block else per_tensor(w, fmt)


def fn_to_fnuz(q: Quantized, source: Format, target: Format) -> Quantized:
    """Convert by value: every e4m3fn value halved is exactly an e4m3fnuz value, and the doubled scale
    restores it. Negative zero becomes zero (fnuz has no -0; its 0x80 is NaN)."""
    halved = oracle.decode(q.codes, source) / np.float32(2)
    return Quantized(oracle.encode(halved, target), (q.scale * np.float32(2)).astype(np.float32), q.amax)


def dequantize(codes: np.ndarray, scale: np.ndarray, fmt: Format, block: int | None) -> np.ndarray:
    """float64 values; exact (an 8-bit value times a float32 scale fits in float64)."""
    values = oracle.as_float64(oracle.decode(codes, fmt))
    if not block:
        return values * np.float64(np.asarray(scale, dtype=np.float32))
    factors = np.ldexp(1.0, np.asarray(scale, dtype=np.int64) - E8M0_BIAS)
    factors[np.asarray(scale) == 0xFF] = np.nan  # e8m0's only NaN
    return values * np.repeat(factors, block, axis=-1)[..., : codes.shape[-1]]
