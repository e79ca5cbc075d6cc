"""fp8 matrix multiply on GPUs that have it (NVIDIA sm_89+, AMD gfx942+): torch._scaled_mm against the oracle,
which dequantizes the same codes with ml_dtypes and multiplies in float64. Elsewhere it reports that it does
not apply. Rank side.
"""

from __future__ import annotations

import re
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
        return _rocm_fp8_format(index)
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= (8, 9):
        return FORMATS["e4m3fn"], f"sm_{major}{minor}"
    return None, f"sm_{major}{minor} has no fp8 matrix multiply (sm_89 or later has)"


def _rocm_fp8_format(index: int) -> tuple[Format | None, str]:
    """MI300 (gfx940-942) multiplies e4m3fnuz; gfx950 and RDNA4 (gfx12) the OCP e4m3fn."""
    arch = (torch.cuda.get_device_properties(index).gcnArchName or "").split(":")[0]
    if arch in ("gfx940", "gfx941", "gfx942"):
        return FORMATS["e4m3fnuz"], arch
    if arch.startswith("gfx95") or arch.startswith("gfx12"):
        return FORMATS["e4m3fn"], arch
    return None, f"{arch} has no fp8 matrix multiply (gfx942 or later has)"


def finite_codes(count: int, fmt: Format, salt: int) -> np.ndarray:
    """Deterministic codes spread over the format, NaN codes left out."""
    finite = np.flatnonzero(np.isfinite(oracle.decode(oracle.all_codes(fmt), fmt))).astype(np.uint8)
    index = (np.arange(count, dtype=np.int64) * 2654435761 + salt * 40503) % finite.size
    return finite[index]


# Who said no, read from torch's message. Checked in this order, first match wins:
# 1. The vendor says the format or this device is not supported: a refusal, a finding about the stack. Also
#    "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+",
#    "Float8_e4m3fn is only supported for ROCm 6.5 and above", CUBLAS_STATUS_NOT_SUPPORTED.
# "requires" only where a platform follows: "requires the scales to be float32" is an argument check.
_UNSUPPORTED = re.compile(r"not supported|unsupported|not_supported|only supported|not implemented|compute capability|"
                          r"requires (cuda|rocm|hip|sm_|gfx|compute|a gpu|an? .*(gpu|device|architecture))")
# 2. torch's own argument checks (aten/src/ATen/native/cuda/ScaledBlas.cpp, _scaled_mm_out_cuda; mkldnn's on the
#    CPU): shapes, strides, dtypes, layout, scales. They judge the plugin's call, not the vendor's kernel, even
#    where they name the format ("Invalid scaling configuration ... Got a.dtype()=Float8_e4m3fnuz"). Nothing here
#    may match a failed kernel ("CUDA error: invalid argument", "an illegal memory access", "out of memory").
_CALL_CHECKS = re.compile(r"expected|must be|must have|must match|cannot be multiplied|divisible|divisble|"
                          r"invalid scaling|col_major|row_major|row-major|column-major|stride|contiguous|"
                          r"per-tensor scaling|same device")
# 3. Left over, a message that names the format or an fp8 architecture is the kernel library turning it down
#    (oneDNN: "itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor inputFloat8_e4m3fnuz").
_ARCH = re.compile(r"sm_?(89|9\d|1\d\d)|gfx9[45]|gfx12")


def classify(exc: BaseException, fmt: Format) -> str:
    """Who turned the call down: "refused" (the stack refuses the format on this device: a finding),
    "call" (torch's argument checks reject the plugin's own call: a bug of the plugin) or "error" (the
    kernel failed: an illegal address, out of memory, a failed launch)."""
    text = str(exc).lower()
    if isinstance(exc, NotImplementedError) or _UNSUPPORTED.search(text):
        return "refused"
    # TypeError: the binding's signature; ValueError: TORCH_CHECK_VALUE, argument validation by definition.
    if isinstance(exc, (TypeError, ValueError)) or _CALL_CHECKS.search(text):
        return "call"
    if fmt.torch_name.lower() in text or fmt.id in text or _ARCH.search(text):
        return "refused"
    return "error"


def check(dev: str, fmt: Format) -> dict[str, Any]:
    """Run _scaled_mm once and compare it with the oracle; worst error as a share of the bound.

    A ``_scaled_mm`` that refuses the format returns ``{"refused": "<error>"}``, one whose argument checks reject
    the call ``{"call_rejected": "<error>"}`` (the judge raises it as the plugin's error), instead of raising."""
    a_codes = finite_codes(M * K, fmt, 1).reshape(M, K)
    b_codes = finite_codes(N * K, fmt, 2).reshape(N, K)  # B is passed column-major: B^T row-major
    dtype = getattr(torch, fmt.torch_name)
    a = torch.from_numpy(a_codes).to(dev).view(dtype)
    b = torch.from_numpy(b_codes).to(dev).view(dtype).t()
    scale_a = torch.tensor(SCALE_A, dtype=torch.float32, device=dev)
    scale_b = torch.tensor(SCALE_B, dtype=torch.float32, device=dev)
    head = {"applicable": True, "format": fmt.id, "shape": [M, K, N]}
    try:
        product = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    # ValueError: torch 2.13's TORCH_CHECK_VALUE ("Invalid scaling configuration"); TypeError: the Python binding.
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        kind = classify(exc, fmt)
        if kind == "error":
            raise  # an illegal address, out of memory, a failed launch: run() reports it as an error, not a refusal
        # "call": the plugin's own call is wrong, never blamed on the vendor. "refused": the stack's kernel library
        # refuses the format (oneDNN on AVX512 CPUs and cuBLASLt refuse e4m3fnuz): a finding, never a crash.
        return {**head, "call_rejected" if kind == "call" else "refused": f"{type(exc).__name__}: {exc}"}
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
    return {**head, "worst_ratio": float(error[worst] / bound[worst]),
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
