"""Kernel switches a triage flip can set in a training config; applied on the rank before the model runs."""

from __future__ import annotations

from typing import Any


def apply_switches(config: dict[str, Any], ctx: Any) -> None:
    """Set the switches ``config`` asks for; register their undo, since in place the process runs on."""
    if ctx.device_kind != "cuda":
        return
    import torch

    cuda = torch.backends.cuda
    saved = (cuda.preferred_blas_library(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
             cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled(), cuda.matmul.allow_bf16_reduced_precision_reduction,
             cuda.matmul.allow_fp16_reduced_precision_reduction)

    def restore() -> None:
        cuda.preferred_blas_library(saved[0])
        cuda.enable_flash_sdp(saved[1])
        cuda.enable_mem_efficient_sdp(saved[2])
        cuda.enable_cudnn_sdp(saved[3])
        cuda.enable_math_sdp(saved[4])
        cuda.matmul.allow_bf16_reduced_precision_reduction = saved[5]
        cuda.matmul.allow_fp16_reduced_precision_reduction = saved[6]

    ctx.cleanup_hooks.append(restore)
    if config.get("blas_library") == "other":
        current = str(cuda.preferred_blas_library()).lower()
        cuda.preferred_blas_library("cublas" if "lt" in current else "cublaslt")
    if config.get("sdpa_backend") == "math":
        cuda.enable_flash_sdp(False)
        cuda.enable_mem_efficient_sdp(False)
        cuda.enable_cudnn_sdp(False)
        cuda.enable_math_sdp(True)
    if config.get("reduced_precision_reduction") is False:
        cuda.matmul.allow_bf16_reduced_precision_reduction = False
        cuda.matmul.allow_fp16_reduced_precision_reduction = False
