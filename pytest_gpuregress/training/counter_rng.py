"""A counter-based random source: splitmix64 over (seed, stream, indices...).

Used wherever a value must be the same on every machine and library version: training data
and initial weights. numpy's and torch's generators promise no such stream stability.
"""

from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, vectorised over uint64 (wraps mod 2**64 by design)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


def hash_words(*parts: np.ndarray | int) -> np.ndarray:
    """Chain splitmix64 over the parts; arrays broadcast against each other."""
    acc = np.asarray(0, dtype=np.uint64)
    for part in parts:
        acc = splitmix64(acc ^ np.asarray(part, dtype=np.uint64))
    return acc


def unit_float(h: np.ndarray) -> np.ndarray:
    """Map a hash to float64 in [0, 1) using its top 53 bits."""
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
