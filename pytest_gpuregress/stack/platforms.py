"""Which devices, backend and world size a run uses, and the platform key of its references."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedPlatform


@dataclass(frozen=True)
class Platform:
    device_kind: str  # cpu | cuda
    backend: str  # gloo | nccl
    world_size: int
    arch: str  # cpu | sm_90 | gfx942 ...
    vendor: str  # cpu | cuda | rocm
    in_place: bool  # already launched by torchrun: this process is one rank

    def key(self, tag: str) -> str:
        """Reference directory name, e.g. ``cpu-gloo-w2-fp32`` or ``rocm-gfx942-nccl-w8-bf16``."""
        device = "cpu" if self.vendor == "cpu" else f"{self.vendor}-{self.arch}"
        return f"{device}-{self.backend}-w{self.world_size}-{tag}"


def launched_by_torchrun() -> bool:
    """RANK and WORLD_SIZE set by torchrun/srun, and not by our own spawner."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not os.environ.get("GPUREGRESS_SPAWNED")


def resolve_platform(device: str = "auto", world_size: int | None = None) -> Platform:
    import torch

    has_gpu = torch.cuda.is_available()
    if device == "cuda" and not has_gpu:
        build = "ROCm" if getattr(torch.version, "hip", None) else ("CUDA" if torch.version.cuda else "CPU-only")
        raise UnsupportedPlatform(
            f"--gpuregress-device cuda: torch {torch.__version__} ({build} build) sees no GPU. "
            "Use --gpuregress-device cpu, or install the CUDA/ROCm build of torch for this machine."
        )
    kind = "cuda" if device == "cuda" or (device == "auto" and has_gpu) else "cpu"
    in_place = launched_by_torchrun()
    if in_place:
        world = int(os.environ["WORLD_SIZE"])
    elif kind == "cuda":
        available = torch.cuda.device_count()
        world = world_size or available
        if world > available:
            raise UnsupportedPlatform(
                f"--gpuregress-world-size {world}: only {available} GPUs are visible on this machine. "
                "Lower the world size, or launch under torchrun across nodes."
            )
    else:
        world = world_size or 2
    if world < 1:
        raise UnsupportedPlatform(f"world size {world}: need at least one rank")
    if kind == "cpu":
        return Platform("cpu", "gloo", world, "cpu", "cpu", in_place)
    rocm = bool(getattr(torch.version, "hip", None))
    return Platform("cuda", "nccl", world, gpu_arch(torch), "rocm" if rocm else "cuda", in_place)


def gpu_arch(torch: Any, index: int = 0) -> str:
    """gfx942 on ROCm (gcnArchName without feature flags), sm_90 on CUDA."""
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return (getattr(props, "gcnArchName", "") or "unknown").split(":")[0]
    return f"sm_{props.major}{props.minor}"
