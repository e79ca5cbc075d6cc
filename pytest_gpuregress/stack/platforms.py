"""Which devices, backend and world size a run uses, and the platform key of its references."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedPlatform
from ..kinds import Backend, DeviceKind, Vendor


@dataclass(frozen=True)
class Platform:
    device_kind: DeviceKind
    backend: Backend
    world_size: int
    arch: str  # cpu | sm_90 | gfx942 ... (open: every new GPU adds one)
    vendor: Vendor
    in_place: bool  # already launched by torchrun: this process is one rank

    def key(self, tag: str) -> str:
        """Reference directory name, e.g. ``cpu-gloo-w2-fp32`` or ``rocm-gfx942-nccl-w8-bf16``."""
        device = "cpu" if self.vendor == "cpu" else f"{self.vendor}-{self.arch}"
        return f"{device}-{self.backend}-w{self.world_size}-{tag}"


SINGLE_RANK_GAPS = "collectives, sharding and resharding cannot be exercised"


def rank_origin(platform: Platform, asked: int | None = None) -> str:
    """Why the run has its ranks, for messages: "one visible GPU", "--gpuregress-world-size=1"."""
    n = platform.world_size
    if platform.in_place:
        return f"WORLD_SIZE={n} under torchrun"
    if asked:
        return f"--gpuregress-world-size={asked}"
    if platform.device_kind == "cuda":
        return "one visible GPU" if n == 1 else f"{n} visible GPUs"
    return f"{n} gloo ranks on the CPU"


def too_few_ranks(needed: int, platform: Platform, asked: int | None = None) -> str | None:
    """The reason a case that needs ``needed`` ranks cannot run here, or None when it can."""
    n = platform.world_size
    if n >= needed:
        return None
    gaps = f"; {SINGLE_RANK_GAPS}" if n == 1 else ""
    return f"needs {needed} or more ranks: this run has {n} ({rank_origin(platform, asked)}){gaps}"


def launched_by_torchrun() -> bool:
    """RANK and WORLD_SIZE set by torchrun (or taken from srun), and not by our own spawner."""
    adopt_srun_environment()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not os.environ.get("GPUREGRESS_SPAWNED")


def adopt_srun_environment(env: dict[str, str] | None = None) -> None:
    """Under ``srun`` with several tasks, give each task torchrun's variables from Slurm's: only inside a job step
    (SLURM_STEP_NUM_TASKS), so a plain ``pytest --gpuregress`` in an allocation still spawns its own ranks. The
    rendezvous address is the user's MASTER_ADDR and MASTER_PORT, as for torchrun's env:// init."""
    env = os.environ if env is None else env
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1)
    if tasks < 2 or "RANK" in env or "SLURM_PROCID" not in env or env.get("GPUREGRESS_SPAWNED"):
        return
    _require_rendezvous(env, tasks)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "")).split("(")[0]
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=str(tasks), LOCAL_RANK=_srun_local_rank(env))
    if per_node.isdigit():
        env["LOCAL_WORLD_SIZE"] = per_node


def _require_rendezvous(env: Mapping[str, str], tasks: int) -> None:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise UnsupportedPlatform(
            f"under srun ({tasks} tasks) {' and '.join(missing)} must be set: export MASTER_ADDR to the first "
            "node's address (e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)) and MASTER_PORT "
            "to a free port before srun, as for torchrun"
        )


def _srun_local_rank(env: Mapping[str, str]) -> str:
    """With --gpus-per-task 1 Slurm shows each task its one GPU as device 0: the local rank is then 0."""
    visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("ROCR_VISIBLE_DEVICES") or env.get("HIP_VISIBLE_DEVICES")
    one_gpu = len([d for d in (visible or "").split(",") if d.strip()]) == 1
    return "0" if one_gpu else env.get("SLURM_LOCALID", "0")


def resolve_platform(device: str = "auto", world_size: int | None = None) -> Platform:
    import torch

    kind = _device_kind(device, torch)
    in_place = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if in_place else _spawned_world(kind, world_size, torch)
    if world < 1:
        raise UnsupportedPlatform(f"world size {world}: need at least one rank")
    if kind == "cpu":
        return Platform("cpu", "gloo", world, "cpu", "cpu", in_place)
    rocm = bool(getattr(torch.version, "hip", None))
    return Platform("cuda", "nccl", world, gpu_arch(torch), "rocm" if rocm else "cuda", in_place)


def _device_kind(device: str, torch: Any) -> str:
    """"cuda" where asked, or for "auto" where a GPU is visible; asking for one that torch cannot see is an error
    naming torch's build."""
    has_gpu = torch.cuda.is_available()
    if device == "cuda" and not has_gpu:
        build = "ROCm" if getattr(torch.version, "hip", None) else ("CUDA" if torch.version.cuda else "CPU-only")
        raise UnsupportedPlatform(
            f"--gpuregress-device cuda: torch {torch.__version__} ({build} build) sees no GPU. "
            "Use --gpuregress-device cpu, or install the CUDA/ROCm build of torch for this machine."
        )
    return "cuda" if device == "cuda" or (device == "auto" and has_gpu) else "cpu"


def _spawned_world(kind: str, asked: int | None, torch: Any) -> int:
    """The ranks this process spawns: as asked, else one per visible GPU (two gloo ranks on a CPU)."""
    if kind != "cuda":
        return asked or 2
    available = torch.cuda.device_count()
    if (asked or available) > available:
        raise UnsupportedPlatform(
            f"--gpuregress-world-size {asked}: only {available} GPUs are visible on this machine. "
            "Lower the world size, or launch under torchrun across nodes."
        )
    return asked or available


def gpu_arch(torch: Any, index: int = 0) -> str:
    """gfx942 on ROCm (gcnArchName without feature flags), sm_90 on CUDA."""
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return (getattr(props, "gcnArchName", "") or "unknown").split(":")[0]
    return f"sm_{props.major}{props.minor}"
