"""What a training loop measures besides its numbers: step times, a kernel inventory and peak memory.

    observer = StepObserver(ctx, steps, tokens_per_step)
    for step in range(steps):
        with observer.step(step):
            ...                                  # one training step
    record.results.update(observer.results())    # "perf", "kernels" and, on GPUs, "host_ops"

Steady steps are those after the first ``WARMUP_STEPS`` (allocation, lazy initialisation, cold
caches) and outside the profiled window (the profiler slows the steps it watches). Their median
is the step time: a median, because a shared CI machine stalls a step now and then.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .kernels import KernelWindow

WARMUP_STEPS = 3
PROFILE_AT = 5  # the first profiled step, or as late as a short run allows
PROFILE_STEPS = 2  # one profiled, one watched for host ops (training/kernels.py)
BANDWIDTH_BYTES = (4 << 20, 64 << 20)  # (CPU, GPU): a few gradient buckets of the model each runs
BANDWIDTH_REPEATS = 10  # a median of ten: gloo on a shared CPU stalls now and then
_CLEAR_REFS = "/proc/self/clear_refs"  # writing "5" resets the peak RSS (VmHWM) on Linux


def profile_window(steps: int) -> range:
    """The steps profiled and watched: two steady ones, or the last ones of a short run."""
    start = max(0, min(PROFILE_AT, steps - PROFILE_STEPS))
    return range(start, min(steps, start + PROFILE_STEPS))


class StepObserver:
    """Times each step, profiles the window's steps, and tracks this rank's peak memory."""

    def __init__(self, ctx: Any, steps: int, tokens_per_step: int) -> None:
        self.window = profile_window(steps) if getattr(ctx, "profile", True) else range(0)
        self.kernels = KernelWindow(ctx.device_kind)
        self.tokens_per_step = tokens_per_step
        self.times: dict[int, float] = {}
        self.window_times: dict[int, float] = {}  # the profiled and watched steps, profiler included
        self._device_kind = ctx.device_kind
        self._device = ctx.device
        self._memory_since = reset_peak_memory(ctx.device_kind, ctx.device)
        self.bus_bandwidth: float | None = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step in self.window:  # the window's first step is profiled, its second watched for host ops
            started = time.perf_counter()
            with self.kernels.capture() if step == self.window.start else self.kernels.watch_host():
                yield
            self.window_times[step] = time.perf_counter() - started
            return
        started = time.perf_counter()
        yield
        self.times[step] = time.perf_counter() - started

    def steady_times(self) -> list[float]:
        steady = [t for s, t in self.times.items() if s >= WARMUP_STEPS]
        return steady or list(self.times.values())

    def finish(self, world_size: int) -> None:
        """After the last step, on every rank: time an all-reduce the size of a gradient bucket (a collective)."""
        if world_size > 1:
            self.bus_bandwidth = measure_bus_bandwidth(self._device, world_size, self._device_kind)

    def timings(self) -> dict[str, float]:
        """The record's timings: training time outside the profiled window, the first and the median step."""
        steady = self.steady_times()
        return {"train_s": float(sum(self.times.values())), "first_step_s": float(self.times.get(0, 0.0)),
                "median_step_s": float(np.median(steady)) if steady else 0.0}

    def results(self) -> dict[str, Any]:
        steady = self.steady_times()
        median = float(np.median(steady)) if steady else 0.0
        perf: dict[str, Any] = {
            "median_step_s": median,
            "steady_steps": len(steady),
            "tokens_per_s": self.tokens_per_step / median if median > 0 else 0.0,
            "peak_memory_bytes": peak_memory(self._device_kind, self._device),
            "memory": "device (max allocated)" if self._device_kind == "cuda" else f"peak RSS {self._memory_since}",
        }
        if self.window_times:  # what profiling cost: the window's steps beyond as many steady steps
            perf["profiling_overhead_s"] = max(0.0, sum(self.window_times.values()) - median * len(self.window_times))
        if self.bus_bandwidth is not None:
            perf["bus_bandwidth_gbps"] = self.bus_bandwidth
        out: dict[str, Any] = {"perf": perf}
        if self.window:
            out.update(self.kernels.results())
        return out


def reset_peak_memory(device_kind: str, device: str) -> str:
    """Start this run's peak-memory count; returns what the CPU figure spans (ranks outlive a job)."""
    if device_kind == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return "of this run"
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return "of this run"
    except OSError:  # not Linux, or not permitted: the peak since the rank started
        return "since the rank started"


def peak_memory(device_kind: str, device: str) -> int:
    if device_kind == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def measure_bus_bandwidth(device: str, world_size: int, device_kind: str) -> float:
    """The median bus bandwidth (GB/s) of ``BANDWIDTH_REPEATS`` fp32 all-reduces of ``BANDWIDTH_BYTES``,
    counted as nccl-tests counts it: algorithm bandwidth x 2(n-1)/n."""
    import torch
    import torch.distributed as dist

    nbytes = BANDWIDTH_BYTES[device_kind == "cuda"]
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buffer)  # warm-up: the first call sets up the connection
    times = []
    for _ in range(BANDWIDTH_REPEATS):
        if device_kind == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dist.all_reduce(buffer)
        if device_kind == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return float(nbytes / float(np.median(times)) * 2 * (world_size - 1) / world_size / 1e9)


def merge_ranks(records: list[Any]) -> dict[str, Any]:
    """Results of every rank folded into rank 0's: the largest peak memory, every rank's host ops."""
    merged: dict[str, Any] = {}
    perfs = [r.results["perf"] for r in records if "perf" in r.results]
    if perfs:
        merged["perf"] = {**perfs[0], "peak_memory_bytes": max(p["peak_memory_bytes"] for p in perfs)}
    hosts = [r.results["host_ops"] for r in records if "host_ops" in r.results]
    if hosts:
        ops: dict[str, Any] = {}
        for host in hosts:
            for op, entry in host["ops"].items():
                ops.setdefault(op, {**entry, "calls": 0})["calls"] += entry["calls"]
        merged["host_ops"] = {"accelerator": hosts[0]["accelerator"], "ops": ops}
    return merged
