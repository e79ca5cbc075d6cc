"""Rounding bounds for the merge check, from the dtype's unit roundoff u (docs/lora.md derives them).

The merged weight must satisfy ``|W' - (W + s B A)| <= ulp(W')/2 + gamma_{r+3} s (|B| @ |A|)`` (float64 on
the right). The check compares weights, not logits: one ulp in one weight moves a logit by ~1e-9, far below
any sound logit bound; the logit bound ``u_chain * max|logits|`` is first order only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...comparison.bounds import UNIT_ROUNDOFF  # 2**-p for p bits of precision


def gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): the relative error of n rounded operations in a row."""
    if n * u >= 1:
        raise ValueError(f"gamma_{n} is unbounded at unit roundoff {u}")
    return n * u / (1 - n * u)


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` numbers at each of ``values`` (normal range; subnormals get the smallest normal's)."""
    magnitude = np.abs(values.astype(np.float64))
    smallest_normal = {"fp32": 2.0**-126, "bf16": 2.0**-126, "fp16": 2.0**-14}[dtype]
    _, exponent = np.frexp(np.maximum(magnitude, smallest_normal))  # magnitude = m * 2**e, m in [0.5, 1)
    return np.ldexp(UNIT_ROUNDOFF[dtype], exponent)  # 2**(e - p)


def merged_weight_bound(merged: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float,
                        dtype: str) -> np.ndarray:
    """Per element: how far the merged weight may lie from W + s B A in exact arithmetic."""
    u = UNIT_ROUNDOFF[dtype]
    rank = lora_a.shape[0]
    product = np.abs(lora_b.astype(np.float64)) @ np.abs(lora_a.astype(np.float64))
    return ulp(merged, dtype) / 2 + gamma(rank + 3, u) * abs(scale) * product


@dataclass(frozen=True)
class Excess:
    count: int  # elements beyond the bound
    worst_ratio: float  # the largest |error| / bound (<= 1 when clean)
    worst_ulps: float  # that element's error in ulps of the merged weight
    index: tuple[int, ...]


def merge_excess(merged: np.ndarray, base: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float,
                 dtype: str) -> Excess:
    """How far a merged weight lies from W + s B A (float64), measured against ``merged_weight_bound``."""
    exact = base.astype(np.float64) + scale * (lora_b.astype(np.float64) @ lora_a.astype(np.float64))
    error = np.abs(merged.astype(np.float64) - exact)
    bound = merged_weight_bound(merged, lora_a, lora_b, scale, dtype)
    ratio = error / bound
    if not ratio.size:
        return Excess(count=0, worst_ratio=0.0, worst_ulps=0.0, index=())
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return Excess(count=int(np.count_nonzero(ratio > 1)), worst_ratio=float(ratio[worst]),
                  worst_ulps=float(error[worst] / ulp(merged[worst], dtype)), index=tuple(int(i) for i in worst))


def merge_factor(merged: np.ndarray, base: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float,
                 dtype: str) -> float | None:
    """k where the merged weight is W + k s B A within the rounding bound of that sum, k not 1: the merge computed
    the adapter's product with other arithmetic (a scaling applied twice or left out). None where no single factor
    explains it (a kernel's error is no multiple of the product), or where the product is zero."""
    delta = merged.astype(np.float64) - base.astype(np.float64)
    product = scale * (lora_b.astype(np.float64) @ lora_a.astype(np.float64))
    norm = float(np.sum(product * product))
    if norm == 0.0:
        return None
    factor = float(np.sum(delta * product) / norm)  # least squares: the one factor that fits best
    if abs(factor - 1.0) <= 1e-6 or merge_excess(merged, base, lora_a, lora_b, scale * factor, dtype).count:
        return None
    return factor


def logits_bound(max_abs_logit: float, inner_dims: list[int], rank: int, dtype: str) -> float:
    """First-order bound on |merged - unmerged logits|: (sum over targeted layers of (3 n + r + 3)) u max|logits|."""
    u = UNIT_ROUNDOFF[dtype]
    return float(sum(3 * n + rank + 3 for n in inner_dims) * u * max_abs_logit)
