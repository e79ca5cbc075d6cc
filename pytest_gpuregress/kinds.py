"""Closed sets of names that several layers share, as ``Literal`` types: a value outside one is a bug of ours.

The option choices that select among them are read from here (plugin/options.py), so the command line, the
code and the docs name the same values. Neutral: every layer may use it. Components are in components.py.
"""

from __future__ import annotations

from typing import Literal

DeviceKind = Literal["cpu", "cuda"]  # ROCm builds of torch report cuda too
Backend = Literal["gloo", "nccl"]  # nccl stands for RCCL on ROCm builds
Vendor = Literal["cpu", "cuda", "rocm"]
LaneChoice = Literal["auto", "exact", "tolerant"]  # --gpuregress-lane: auto picks exact when the numerics match
GateMode = Literal["warn", "fail", "off"]  # --gpuregress-perf
KernelChanges = Literal["report", "fail", "off"]  # --gpuregress-kernel-changes
