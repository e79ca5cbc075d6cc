"""Noise replicas: the perturbations a healthy stack can legitimately produce, for the noise envelope.

Their spread sets the tolerant lane's limits (comparison/envelope.py, docs/envelope.md): weights one ulp up or
down, each batch in reverse row order, another kernel path. Planned on the session side; ``apply_*`` run on
the ranks, as do the kernel switches a triage flip sets in a training config (``apply_switches``).
"""

from __future__ import annotations

from typing import Any

PERTURBATIONS = (
    "weights_ulp_up",
    "reduction_order",
    "kernel_path",
    "weights_ulp_down",
    "weights_ulp_up+reduction_order",
    "weights_ulp_down+kernel_path",
)
DEFAULT_REPLICAS = 3  # one of each kind: recording costs 4 plain runs
# ATen's CPU kernel sets, each with the next lower one to fall back to.
_LOWER_CPU_CAPABILITY = {"AVX512": "avx2", "AVX2": "default", "SVE256": "default", "SVE128": "default"}


def lower_cpu_capability() -> str | None:
    """The next lower ATEN_CPU_CAPABILITY of this machine, or None when it already runs the default."""
    import torch

    current = str(torch.backends.cpu.get_cpu_capability()).upper()
    return _LOWER_CPU_CAPABILITY.get(current)


def replica_plan(count: int, device_kind: str) -> list[tuple[str, dict[str, str]]]:
    """(perturbation, extra environment) for each of ``count`` replicas."""
    plan = []
    for perturbation in PERTURBATIONS[:count]:
        env: dict[str, str] = {}
        if "kernel_path" in perturbation and device_kind == "cpu":
            lower = lower_cpu_capability()
            if lower is not None:
                env["ATEN_CPU_CAPABILITY"] = lower
        plan.append((perturbation, env))
    return plan


# --- on the ranks --------------------------------------------------------------------------------


def apply_weight_perturbation(model: Any, perturbation: str, dtype: str) -> None:
    """Nudge every weight one ulp of the compute dtype up or down (before sharding)."""
    perturb_weights(model.parameters(), perturbation, dtype)


def perturb_weights(params: Any, perturbation: str, dtype: str) -> bool:
    """The same for any parameters, FSDP2 shards too (each rank nudges its own); True when it applied."""
    import torch

    if "weights_ulp" not in perturbation:
        return False
    up = "weights_ulp_up" in perturbation
    with torch.no_grad():
        for param in params:
            param = param.to_local() if hasattr(param, "to_local") else param  # a view of the shard: nudged in place
            if dtype == "bf16":  # one bf16 ulp: an fp32 ulp would vanish in the cast to the compute dtype
                value = param.to(torch.bfloat16).float()
                ulp = torch.ldexp(torch.ones_like(value), torch.frexp(value)[1] - 8)
                param.copy_(value + ulp if up else value - ulp)
            else:
                param.copy_(torch.nextafter(param, torch.full_like(param, float("inf") if up else float("-inf"))))
    return True


def apply_batch_order(tokens: Any, perturbation: str) -> Any:
    """The rank's batch rows in reverse order for ``reduction_order``: the same mean, summed in another order."""
    return tokens.flip(0) if "reduction_order" in perturbation else tokens


def apply_kernel_path(perturbation: str, ctx: Any) -> str | None:
    """On GPUs, switch to the other BLAS library (undone after the run); the CPU switch is the environment."""
    if "kernel_path" not in perturbation or ctx.device_kind != "cuda":
        return None
    import torch

    current = torch.backends.cuda.preferred_blas_library()
    other = _other_blas(current)
    torch.backends.cuda.preferred_blas_library(other)
    ctx.cleanup_hooks.append(lambda: torch.backends.cuda.preferred_blas_library(current))
    return other


def _other_blas(current: object) -> str:
    """cuBLAS for cuBLASLt (hipBLASLt), and the other way round."""
    return "cublas" if "lt" in str(current).lower() else "cublaslt"


SDPA_BACKENDS = ("flash", "mem_efficient", "cudnn", "math")  # torch.backends.cuda.<name>_sdp_enabled


def apply_switches(config: dict[str, Any], ctx: Any) -> None:
    """Set the kernel switches a triage flip asks for in ``config`` (GPUs only); register their undo, since in
    place the process runs on."""
    if ctx.device_kind != "cuda":
        return
    import torch

    cuda = torch.backends.cuda
    blas = cuda.preferred_blas_library()
    sdpa = {name: getattr(cuda, f"{name}_sdp_enabled")() for name in SDPA_BACKENDS}
    reduced = (cuda.matmul.allow_bf16_reduced_precision_reduction, cuda.matmul.allow_fp16_reduced_precision_reduction)

    def restore() -> None:
        cuda.preferred_blas_library(blas)
        for name, on in sdpa.items():
            getattr(cuda, f"enable_{name}_sdp")(on)
        cuda.matmul.allow_bf16_reduced_precision_reduction, cuda.matmul.allow_fp16_reduced_precision_reduction = reduced

    ctx.cleanup_hooks.append(restore)
    if config.get("blas_library") == "other":
        cuda.preferred_blas_library(_other_blas(cuda.preferred_blas_library()))
    if config.get("sdpa_backend") == "math":
        for name in SDPA_BACKENDS:
            getattr(cuda, f"enable_{name}_sdp")(name == "math")
    if config.get("reduced_precision_reduction") is False:
        cuda.matmul.allow_bf16_reduced_precision_reduction = cuda.matmul.allow_fp16_reduced_precision_reduction = False
