"""Platform-independent initial values: N(0, std^2) from a counter-based hash of (seed, parameter name).

Through Box-Muller in float64, never torch's or transformers' random streams, so a new library version
that reorders module construction or changes its init code cannot move the starting point. The shipped
models (models.py) and a user's factory model (factory.py) are seeded alike.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .counter_rng import hash_words, unit_float


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) samples keyed by (seed, name), identical on every platform."""
    count = int(np.prod(shape)) if shape else 1
    key = zlib.crc32(name.encode())
    idx = np.arange((count + 1) // 2, dtype=np.uint64)
    u1 = unit_float(hash_words(seed, 10, key, idx))
    u2 = unit_float(hash_words(seed, 11, key, idx))
    radius = np.sqrt(-2.0 * np.log1p(-u1))  # 1 - u1 is in (0, 1], so log is finite
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:count]
    return (z * std).reshape(shape)



def seed_parameters(model: Any, seed: int, std: float) -> None:
    """Every parameter from (seed, its name): N(0, std^2) weights, zero biases, unit normalisation gains."""
    import torch

    # Normalisation gains start at 1: by name (norm.weight, layernorm.weight) or by module class (GPT-2's
    # ln_1, ln_f are LayerNorms); for the shipped models both rules pick the same parameters.
    gains = {f"{module_name}.weight" if module_name else "weight" for module_name, module in model.named_modules()
             if "Norm" in type(module).__name__}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name in gains:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = seeded_normal(seed, name, tuple(param.shape), std)
                param.copy_(torch.from_numpy(values).to(param.dtype))
