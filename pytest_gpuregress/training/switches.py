"""Kernel switches a triage flip can set in a training config; applied on the rank before the model runs."""

from __future__ import annotations

from typing import Any


def apply_switches(config: dict[str, Any], device_kind: str) -> None:
    if device_kind != "cuda":
        return
    import torch

    if config.get("blas_library") == "other":
        current = str(torch.backends.cuda.preferred_blas_library()).lower()
        torch.backends.cuda.preferred_blas_library("cublas" if "lt" in current else "cublaslt")
    if config.get("sdpa_backend") == "math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    if config.get("reduced_precision_reduction") is False:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
