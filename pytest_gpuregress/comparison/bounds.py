"""The derived bound between two computations of the same step-0 numbers that differ only in rounding
(N ranks against one, fp32 against the float64 oracle), used by triage and the checkpoint portability check:

    bound = u x sqrt(n) x (L + 1)

n-term sums under the probabilistic rounding model (Higham and Mary 2019), grown per layer read; u is the unit
roundoff the sums run in. The derivation and its measured margins: docs/triage.md.
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}


def step0_bound(dtype: str, tokens: int, layers: int) -> float:
    """Largest allowed |a - b| / max|b| between two step-0 computations that differ only in rounding."""
    depth = layers + 1
    if dtype == "fp32":
        return UNIT_ROUNDOFF["fp32"] * math.sqrt(tokens) * depth
    # Reduced-precision compute with fp32 reduction: the forward rounds in the compute dtype at each depth.
    return UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["bf16"]) * depth + UNIT_ROUNDOFF["fp32"] * math.sqrt(tokens) * depth
