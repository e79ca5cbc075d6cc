"""The derived bound between two computations of the same step-0 numbers that differ only in rounding.

Triage's reference-free experiments compare two such computations (the checkpoint scenario's
portability check reuses the bound):
  - N ranks against one: each gradient element is a sum over the n tokens of the global batch. One
    rank adds all n in one kernel; N ranks add n/N each and the reduce-scatter adds the N partial
    sums. Same terms, another order.
  - the oracle: the same sums in float64, whose own rounding is negligible against fp32 or bf16.
Under the probabilistic model of rounding error (Higham and Mary, SIAM J. Sci. Comput. 2019) the
error of an n-term sum grows like u x sqrt(n), not the worst case u x n. A difference in the
forward pass (another batch split can round an activation differently) enters again at every
layer the next one reads, so the bound also grows with depth: L decoder layers plus the head.
Measured against the largest element of the same tensor (tensor scale, as the comparison does):

    bound = u x sqrt(n) x (L + 1)

u is the unit roundoff of the dtype the sums run in: fp32 (2^-24) on the CPU; on GPUs the
bf16 compute (2^-8) sets the forward's rounding while gradients are reduced in fp32, so there
u = 2^-8 x (L + 1) bounds the forward and the sqrt(n) term uses fp32's u.

On the CPU model (n = 16 x 64 = 1,024 tokens, L = 2) the bound is 5.7e-6. Measured: N ranks
against one differ by at most 3.4e-7 in any step-0 gradient (17x inside), fp32 against float64 by
3.6e-7; one reduce-scatter element off by 1e-4 moves its tensor by 2.4e-5 (4x outside), and
linear layers with 1e-4 relative noise move step-0 gradients by about 1e-4.
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
