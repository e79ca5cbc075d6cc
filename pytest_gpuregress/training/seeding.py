"""Platform-independent initial values: N(0, std^2) from a counter-based hash of (seed, parameter name).

No library random stream, so a library that reorders construction or changes its init cannot move the
starting point. Parameters of ``MIN_CACHED`` elements or more are cached on disk (init_cache.py).
"""

from __future__ import annotations

import functools
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from .counter_rng import hash_words, splitmix64, unit_float
from .init_cache import Entry, InitCache, default_root, fetch


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else all): the size of host-side
    thread pools (seeding, the float64 oracle)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


BLOCK = 1 << 15  # pairs a block: its temporaries (a few MiB) stay in the CPU's caches
THREADS = min(8, usable_cpus())
MIN_CACHED = 1 << 16  # elements: below, computing (a few ms) costs about what reading and checking a file does
CACHED_DTYPES = ("float32", "float64", "float16")  # those numpy (and so the cache's safetensors) holds


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) samples keyed by (seed, name), identical on every platform: Box-Muller over pairs of counter
    hashes, block by block (threaded), each element through the same float64 ops as one whole-array pass."""
    count = int(np.prod(shape)) if shape else 1
    key = zlib.crc32(name.encode())
    half = (count + 1) // 2
    streams = hash_words(seed, 10, key), hash_words(seed, 11, key)  # hash_words(seed, s, key, i), less its last step
    out = np.empty(2 * half)

    def block(start: int) -> None:
        idx = np.arange(start, min(start + BLOCK, half), dtype=np.uint64)
        u1 = unit_float(splitmix64(streams[0] ^ idx))
        u2 = unit_float(splitmix64(streams[1] ^ idx))
        radius = np.sqrt(-2.0 * np.log1p(-u1))  # 1 - u1 is in (0, 1], so log is finite
        angle = 2 * np.pi * u2
        np.multiply(radius, np.cos(angle), out=out[start:start + idx.size])
        np.multiply(radius, np.sin(angle), out=out[half + start:half + start + idx.size])

    starts = range(0, half, BLOCK)
    workers = min(len(starts), THREADS)
    if workers > 1:  # numpy lets go of the GIL inside each operation
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(block, starts))
    else:
        for start in starts:
            block(start)
    z = out[:count]
    z *= std
    return z.reshape(shape)


def seed_parameters(model: Any, seed: int, std: float, cache: InitCache | None | Literal["env"] = "env") -> None:
    """Every parameter from (seed, its name): N(0, std^2) weights, zero biases, unit norm gains. ``cache`` keeps
    large ones between launches: "env", the environment's folder (init_cache.default_root); None, none."""
    import torch

    # Normalisation gains start at 1: by name (*norm.weight) or by module class (GPT-2's
    # ln_1, ln_f are LayerNorms); for the shipped models both rules pick the same parameters.
    gains = {f"{module_name}.weight" if module_name else "weight" for module_name, module in model.named_modules()
             if "Norm" in type(module).__name__}
    seeded = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name in gains:  # covers layernorm.weight
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                seeded.append((name, param))
        initialise(seed, std, seeded, default_cache() if cache == "env" else cache)


def initialise(seed: int, std: float, named: list[tuple[str, Any]], cache: InitCache | None) -> None:
    """Write each of ``named``'s seeded values, in its dtype, into the parameter (under no_grad); large ones via
    ``cache``."""
    import torch

    def cacheable(param: Any) -> bool:
        return (cache is not None and param.numel() >= MIN_CACHED and dtype_name(param.dtype) in CACHED_DTYPES
                and param.device.type == "cpu" and param.layout == torch.strided and param.is_contiguous())

    for name, param in named:
        if not cacheable(param):
            param.copy_(normal_tensor(seed, name, tuple(param.shape), std, param.dtype))
    entries = [(Entry(seed, name, tuple(param.shape), float(std), dtype_name(param.dtype)), param.detach().numpy())
               for name, param in named if cacheable(param)]  # numpy views: the cache reads into the parameters
    if cache is not None and entries:
        fetch(cache, entries, lambda e: normal_tensor(e.seed, e.name, e.shape, e.std, getattr(torch, e.dtype)).numpy())


def normal_tensor(seed: int, name: str, shape: tuple[int, ...], std: float, dtype: Any) -> Any:
    """seeded_normal's float64 values rounded to ``dtype`` (a torch dtype) by torch, as a tensor."""
    import torch

    return torch.from_numpy(seeded_normal(seed, name, shape, std)).to(dtype)


def dtype_name(dtype: Any) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).removeprefix("torch.")


def default_cache() -> InitCache | None:
    """The cache in the environment's folder; None where it is off or the code's source cannot be read."""
    root, code = default_root(), code_identity()
    return InitCache(root, code) if root is not None and code is not None else None


@functools.lru_cache(maxsize=1)
def code_identity() -> str | None:
    """What seeded values depend on besides their entry: the source computing them, numpy's version, SIMD paths
    and C library, so unlike machines never share values; None where the source cannot be read."""
    import hashlib
    import importlib
    import inspect
    import json
    import platform

    from . import counter_rng

    try:
        source = inspect.getsource(counter_rng) + inspect.getsource(seeded_normal) + inspect.getsource(normal_tensor)
    except (OSError, TypeError):
        return None
    simd: list[str] = []
    for where in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            features = getattr(importlib.import_module(where), "__cpu_features__", {})
        except ImportError:
            continue
        simd = sorted(k for k, on in features.items() if on)
        break
    facts = {"source": hashlib.sha256(source.encode()).hexdigest(), "numpy": np.__version__, "simd": simd,
             "machine": platform.machine(), "libc": list(platform.libc_ver())}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
