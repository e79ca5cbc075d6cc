"""fp8 matrix multiply on GPUs that have it: torch._scaled_mm against the oracle. Rank side.

Runs where the GPU multiplies fp8 natively: NVIDIA sm_89 and later (e4m3fn), AMD gfx942 (MI300,
e4m3fnuz) and gfx950 and later (e4m3fn). Elsewhere, the CPU included, the check reports that it
does not apply. The oracle dequantizes the same codes with ml_dtypes and multiplies in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import oracle
from .catalog import FORMATS, Format

M, K, N = 64, 128, 48  # multiples of 16, as _scaled_mm requires
SCALE_A, SCALE_B = 0.75, 1.25  # not powers of two, so a scale applied twice or not at all shows
# Bound on the accumulator's unit roundoff. Hopper's fp8 tensor cores keep about 14 bits while they
# accumulate (DeepSeek-V3 technical report, section 3.3.2); 2**-13 leaves a factor 2 on top of that.
ACCUMULATOR_ROUNDOFF = 2.0**-13
FP32_ROUNDOFF = 2.0**-24


def fp8_matmul_format(dev: str) -> tuple[Format | None, str]:
    """The fp8 format this device multiplies natively, or None and why the check does not apply."""
    if not dev.startswith("cuda"):
        return None, "torch._scaled_mm runs on GPUs with fp8 matrix multiply (sm_89+ or gfx942+); not on the cpu"
    if not hasattr(torch, "_scaled_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_mm"
    index = torch.device(dev).index or 0
    if getattr(torch.version, "hip", None):
        arch = (torch.cuda.get_device_properties(index).gcnArchName or "").split(":")[0]
        if arch in ("gfx940", "gfx941", "gfx942"):
            return FORMATS["e4m3fnuz"], arch
        if arch.startswith("gfx95") or arch.startswith("gfx12"):
            return FORMATS["e4m3fn"], arch
        return None, f"{arch} has no fp8 matrix multiply (gfx942 or later has)"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= (8, 9):
        return FORMATS["e4m3fn"], f"sm_{major}{minor}"
    return None, f"sm_{major}{minor} has no fp8 matrix multiply (sm_89 or later has)"


def finite_codes(count: int, fmt: Format, salt: int) -> np.ndarray:
    """Deterministic codes spread over the format, NaN codes left out."""
    finite = np.flatnonzero(np.isfinite(oracle.decode(oracle.all_codes(fmt), fmt))).astype(np.uint8)
    index = (np.arange(count, dtype=np.int64) * 2654435761 + salt * 40503) % finite.size
    return finite[index]


_REFUSAL_WORDS = ("not supported", "unsupported", "not implemented", "expects", "expected")


def refuses_format(exc: BaseException, fmt: Format) -> bool:
    """Whether ``exc`` is the kernel library turning the format down, rather than the kernel failing."""
    text = str(exc).lower()
    named = fmt.torch_name.lower() in text or fmt.id in text  # "...tensor inputFloat8_e4m3fnuz" (oneDNN)
    return isinstance(exc, NotImplementedError) or named or any(word in text for word in _REFUSAL_WORDS)


def check(dev: str, fmt: Format) -> dict[str, Any]:
    """Run _scaled_mm once and compare it with the oracle; worst error as a share of the bound.

    A ``_scaled_mm`` that refuses the format returns ``{"refused": "<error>"}`` instead of raising."""
    a_codes = finite_codes(M * K, fmt, 1).reshape(M, K)
    b_codes = finite_codes(N * K, fmt, 2).reshape(N, K)  # B is passed column-major: B^T row-major
    dtype = getattr(torch, fmt.torch_name)
    a = torch.from_numpy(a_codes).to(dev).view(dtype)
    b = torch.from_numpy(b_codes).to(dev).view(dtype).t()
    scale_a = torch.tensor(SCALE_A, dtype=torch.float32, device=dev)
    scale_b = torch.tensor(SCALE_B, dtype=torch.float32, device=dev)
    try:
        product = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        if not refuses_format(exc, fmt):
            raise  # an illegal address, out of memory, a failed launch: run() reports it as an error, not a refusal
        # The stack's kernel library refuses the format (oneDNN on AVX512 CPUs and cuBLASLt refuse e4m3fnuz):
        # a fact about this stack, reported as a finding by the judge, never a crash of the case.
        return {"applicable": True, "format": fmt.id, "shape": [M, K, N], "refused": f"{type(exc).__name__}: {exc}"}
    got = oracle.as_float64(product.cpu().numpy())
    a64 = oracle.decode(a_codes, fmt).astype(np.float64)
    b64 = oracle.decode(b_codes, fmt).astype(np.float64).T
    expected = (a64 @ b64) * (SCALE_A * SCALE_B)
    magnitude = (np.abs(a64) @ np.abs(b64)) * (SCALE_A * SCALE_B)
    # The bound, per element. Each product of two e4m3 values has at most 8 significant bits, so it
    # is exact in the accumulator. Summing K of them with unit roundoff u, in any order or blocking,
    # errs by at most gamma_K * sum|a_ik b_kj|, gamma_K = K u / (1 - K u) (Higham, Accuracy and
    # Stability of Numerical Algorithms, 2nd ed., section 3.1). Applying the two scales and rounding
    # the output to float32 add at most 3 float32 roundings of the result.
    gamma = K * ACCUMULATOR_ROUNDOFF / (1 - K * ACCUMULATOR_ROUNDOFF)
    bound = gamma * magnitude + 3 * FP32_ROUNDOFF * np.abs(expected)
    error = np.abs(got - expected)
    worst = np.unravel_index(int(np.argmax(error / np.maximum(bound, np.finfo(np.float64).tiny))), error.shape)
    return {"applicable": True, "format": fmt.id, "shape": [M, K, N], "worst_ratio": float(error[worst] / bound[worst]),
            "worst_at": [int(i) for i in worst], "expected": float(expected[worst]), "got": float(got[worst]),
            "bound": float(bound[worst]), "non_finite": int((~np.isfinite(got)).sum())}


def run(dev: str) -> dict[str, Any]:
    fmt, why = fp8_matmul_format(dev)
    if fmt is None:
        return {"applicable": False, "reason": why}
    try:
        return {**check(dev, fmt), "arch": why}
    except RuntimeError as exc:  # a GPU that should multiply fp8 and cannot is a finding, not a crash
        return {"applicable": True, "format": fmt.id, "arch": why, "error": f"{type(exc).__name__}: {exc}"}
