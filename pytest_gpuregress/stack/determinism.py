"""Every determinism switch in one place (after torchtitan's ``set_determinism``), set on every rank first.

What it set goes into the fingerprint (``numerics.determinism.*``), so the exact lane applies only under the
same switches. GPUs run strict mode with SDPA on the math backend alone (the fused backwards are not
deterministic on every release); where a device cannot be made deterministic the run is warn-only, says why
(``nondeterministic_reason``) and takes the tolerant lane. Per platform: docs/gpu.md, "Determinism on GPUs".
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

from ..kinds import Vendor

CUBLAS_DEFAULT = ":4096:8"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the only values with which torch calls cuBLAS deterministic
ROCBLAS_ATOMICS_OFF = "0"
# "warn": warn-only mode where strict mode raises (an op without a deterministic kernel); the exact lane is off then.
MODE_VARIABLE = "GPUREGRESS_DETERMINISM"
SDPA_BACKENDS = ("cudnn", "flash", "math", "mem_efficient")
# SDPA backends allowed per platform: those whose backward is deterministic on every supported torch.
SDPA_ALLOWED: dict[str, tuple[str, ...]] = {"cpu": SDPA_BACKENDS, "cuda": ("math",), "rocm": ("math",)}


@dataclass(frozen=True)
class Plan:
    """What ``set_determinism`` sets on a platform; ``reason`` says why it cannot be deterministic (None: it can)."""

    platform: Vendor
    sdpa_backends: tuple[str, ...]
    reason: str | None

    @property
    def deterministic(self) -> bool:
        return self.reason is None


def platform_of(device_kind: str, torch: Any) -> str:
    """``device_kind`` is "cuda" on ROCm too (torch's HIP build keeps the name); torch.version.hip tells them apart."""
    if device_kind != "cuda":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def plan(device_kind: str) -> Plan:
    """The determinism settings for this platform, read without changing anything (the header uses it too)."""
    import torch

    platform = platform_of(device_kind, torch)
    return Plan(platform, SDPA_ALLOWED[platform], _obstacle(platform, torch))


def _obstacle(platform: str, torch: Any) -> str | None:
    if os.environ.get(MODE_VARIABLE, "strict").lower() == "warn":
        return f"{MODE_VARIABLE}=warn asks for warn-only mode (for a model with an op that has no deterministic kernel)"
    if platform == "cpu":
        return None
    if getattr(torch.backends.cuda, "enable_math_sdp", None) is None:
        return f"torch {torch.__version__} has no switch to route attention (SDPA) to its deterministic math backend"
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DEFAULT)
    if platform == "cuda" and cublas not in CUBLAS_DETERMINISTIC:
        return (f"CUBLAS_WORKSPACE_CONFIG={cublas} was set before the run; cuBLAS is deterministic only with "
                f"{' or '.join(CUBLAS_DETERMINISTIC)}")
    atomics = os.environ.get("ROCBLAS_DEFAULT_ATOMICS_MODE", ROCBLAS_ATOMICS_OFF)
    if platform == "rocm" and atomics != ROCBLAS_ATOMICS_OFF:
        return f"ROCBLAS_DEFAULT_ATOMICS_MODE={atomics} was set before the run: rocBLAS GEMMs may use atomics"
    return None


def _route_sdpa(torch: Any, allowed: tuple[str, ...]) -> None:
    for backend in SDPA_BACKENDS:
        switch = getattr(torch.backends.cuda, f"enable_{backend}_sdp", None)
        if switch is not None:  # a torch without the switch has no such backend
            switch(backend in allowed)


def set_determinism(seed: int, *, device_kind: str, cpu_threads: int | None = 1) -> dict[str, Any]:
    """Seed every generator and force deterministic kernels; return what was set. ``cpu_threads``: intra-op threads
    per rank; one keeps CPU reductions in a fixed order (another count changes float sums) and ranks off each other's cores."""
    import numpy as np
    import torch

    chosen = plan(device_kind)
    # cuBLAS and rocBLAS read these when their first handle is created: before any GPU work.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DEFAULT)
    if chosen.platform == "rocm":
        os.environ.setdefault("ROCBLAS_DEFAULT_ATOMICS_MODE", ROCBLAS_ATOMICS_OFF)
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device_kind == "cuda":
        torch.cuda.manual_seed_all(seed)
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    # Process-wide numerics a previous job in a reused rank may have changed: back to torch's defaults.
    torch.set_default_dtype(torch.float32)
    torch.set_flush_denormal(False)
    _route_sdpa(torch, chosen.sdpa_backends)
    # Strict wherever determinism can be had: warn-only would run nondeterministic kernels and only warn.
    torch.use_deterministic_algorithms(True, warn_only=not chosen.deterministic)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 silently lowers fp32 matmul precision on Ampere+ and its default moved between releases.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {
        "seed": seed,
        "cpu_threads": cpu_threads,
        "deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32": False,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        # Added with GPU determinism. References recorded before lack them, and a key a reference lacks
        # never decides its lane (fingerprint.numerics_diff), so the keys above keep their CPU values.
        "platform": chosen.platform,
        "warn_only": not chosen.deterministic,
        "sdpa_backends": ",".join(chosen.sdpa_backends),
        # rocBLAS reads it on ROCm only: elsewhere a value left in the environment must not change the lane.
        "rocblas_atomics_mode": os.environ.get("ROCBLAS_DEFAULT_ATOMICS_MODE") if chosen.platform == "rocm" else None,
        "deterministic": chosen.deterministic,
        "nondeterministic_reason": chosen.reason,
    }


def nondeterminism(fingerprint: dict[str, Any]) -> str | None:
    """Why the run with this fingerprint could not be made deterministic; None when it could, or says nothing."""
    numerics = fingerprint.get("numerics") or {}
    if numerics.get("determinism.deterministic", True) is not False:
        return None
    return numerics.get("determinism.nondeterministic_reason") or "no reason recorded"


def header_lines(device_kind: str) -> list[str]:
    """The report header's word on determinism on a GPU, or wherever it cannot be had; none on a deterministic CPU."""
    chosen = plan(device_kind)
    if chosen.platform == "cpu" and chosen.deterministic:
        return []
    if chosen.deterministic:
        return [f"gpuregress determinism ({chosen.platform}): strict deterministic algorithms, SDPA on "
                f"{'/'.join(chosen.sdpa_backends)} only, TF32 off: a rerun on this stack must be bitwise equal"]
    return [f"gpuregress determinism ({chosen.platform}): NOT deterministic, {chosen.reason}; warn-only mode, "
            "so every comparison uses the tolerant lane"]
