"""The components a finding can point at: one vocabulary for the comparator, triage, known issues and reports.

A report sends a bug to a vendor by this name, so a name outside it is a bug of ours. A finding names one
component, two the evidence cannot yet tell apart (``collective or kernel``), or ``library: <package>``.
"""

from __future__ import annotations

from typing import Literal, get_args

Component = Literal[
    "collective",  # NCCL, RCCL, gloo: a collective returned other numbers
    "kernel",  # a compute kernel (BLAS, attention, a conversion)
    "optimizer",  # the update: AdamW's implementation, clipping, the schedule
    "checkpoint",  # saving or loading training state or weights
    "format",  # a number format: fp8 and fp4 encodings, scales, saturation
    "quantization",  # a quantized matmul or its scales
    "model",  # the model's own code or layout (a transformers release)
    "library",  # a library's code (peft, accelerate, transformers) rather than a kernel under it
    "data",  # the tokens a run read
    "device",  # one device or node that differs from the fleet
    "performance",  # throughput or memory, not numbers
    "driver",  # known issues: the GPU driver
    "firmware",
    "compiler",
    "runtime",  # the CUDA or ROCm runtime
    "unknown",  # a finding no evidence points anywhere yet
]
COMPONENTS: tuple[str, ...] = get_args(Component)
# Bracketed tags that are no component: a fault that proves nothing, an error no check explains, an op a stack
# does not support.
OTHER_TAGS = ("fault", "unknown error", "not supported")


def parts(name: str) -> list[str]:
    """The components a name is made of: ``collective or kernel`` -> both; ``library: peft`` -> library."""
    return [part.split(":", 1)[0].strip() for part in name.split(" or ")]


def known(name: str) -> bool:
    return bool(name) and all(part in COMPONENTS for part in parts(name))


def tag(name: str) -> str:
    """``[name]``, as a finding line begins; a name outside the vocabulary is an error of this plugin."""
    if not known(name):
        raise ValueError(f"component {name!r} is not one of {', '.join(COMPONENTS)} (pytest_gpuregress/components.py)")
    return f"[{name}]"
