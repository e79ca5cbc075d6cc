"""What a training loop measures besides its numbers: step times, a kernel inventory and peak memory.

The step time is the median of the steady steps (after ``WARMUP_STEPS``, outside the profiled window):
a median, because a shared CI machine stalls a step now and then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..fault_points import plugin_own_collectives
from .kernels import KernelWindow, add_host_ops, add_inventory

WARMUP_STEPS = 3
PROFILE_AT = 5  # the first profiled step, or as late as a short run allows
PROFILE_STEPS = 2  # one profiled, one watched for host ops (training/kernels.py)
BANDWIDTH_BYTES = (4 << 20, 64 << 20)  # (CPU, GPU): a few gradient buckets of the model each runs
BANDWIDTH_REPEATS = 10  # a median of ten: gloo on a shared CPU stalls now and then
BANDWIDTH_MIN_STEADY_STEPS = 20
_CLEAR_REFS = "/proc/self/clear_refs"  # writing "5" resets the peak RSS (VmHWM) on Linux


def profile_window(steps: int) -> range:
    """The steps profiled and watched: two steady ones, or the last ones of a short run."""
    start = max(0, min(PROFILE_AT, steps - PROFILE_STEPS))
    return range(start, min(steps, start + PROFILE_STEPS))


class StepObserver:
    """Times each step, profiles the window's steps, and tracks how much memory this rank's training takes."""

    def __init__(self, ctx: Any, steps: int, tokens_per_step: int) -> None:
        self.window = profile_window(steps) if getattr(ctx, "profile", True) else range(0)
        self.kernels = KernelWindow(ctx.device_kind)
        self.tokens_per_step = tokens_per_step
        self.times: dict[int, float] = {}
        self.window_times: dict[int, float] = {}  # the profiled and watched steps, profiler included
        self._ctx = ctx
        self._memory = PeakMemory(ctx.device_kind, ctx.device)
        self.peak_bytes: int | None = None
        self.bus_bandwidth: float | None = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step in self.window:  # the window's first step is profiled, its second watched for host ops
            started = time.perf_counter()
            with self.kernels.capture() if step == self.window.start else self.kernels.watch_host():
                yield
            self.window_times[step] = time.perf_counter() - started
        else:
            started = time.perf_counter()
            yield
            self.times[step] = time.perf_counter() - started
        if step == 0:
            # The peak counts from step 1: step 0's op trace (evidence/op_tracer.py) holds digests and outputs that
            # are not training memory, and step 1 on holds all step 0 made, so the figure is the same with the
            # trace on or off. Perf is judged on steady steps only, never on a run that stopped after step 0.
            self._memory.restart()

    def steady_times(self) -> list[float]:
        """Step times after the warm-up, outside the window: [] when a run stopped before any (fail-fast)."""
        return [t for s, t in self.times.items() if s >= WARMUP_STEPS]

    def finish(self, world_size: int) -> None:
        """After the last step, on every rank: read the peak memory, then (a collective, its buffer not counted)
        time an all-reduce of a few gradient buckets where the figures will be judged (comparison/perf.py)."""
        self.peak_bytes = self._memory.peak()
        if world_size > 1 and len(self.steady_times()) >= BANDWIDTH_MIN_STEADY_STEPS:
            self._ctx.progress("measuring the all-reduce bus bandwidth")
            with plugin_own_collectives():  # a probe of the plugin's, not the training: no fault acts on it
                self.bus_bandwidth = measure_bus_bandwidth(self._ctx.device, world_size, self._ctx.device_kind)

    def timings(self) -> dict[str, float]:
        """The record's timings: all training time (the window's steps too), the first and the median step."""
        steady = self.steady_times()
        return {"train_s": float(sum(self.times.values()) + sum(self.window_times.values())),
                "first_step_s": float(self.times.get(0, self.window_times.get(0, 0.0))),
                "median_step_s": float(np.median(steady)) if steady else 0.0}

    def results(self) -> dict[str, Any]:
        """"perf" when steady steps ran, "kernels" when the profiled step ran, "host_ops" when the watched one did."""
        out: dict[str, Any] = {}
        steady = self.steady_times()
        if steady:
            median = float(np.median(steady))
            perf: dict[str, Any] = {
                "median_step_s": median,
                "steady_steps": len(steady),
                "tokens_per_s": self.tokens_per_step / median if median > 0 else 0.0,
                "peak_memory_bytes": self.peak_bytes if self.peak_bytes is not None else self._memory.peak(),
                "memory": self._memory.kind,
            }
            if self.window_times:  # what profiling cost: the window's steps beyond as many steady steps
                perf["profiling_overhead_s"] = max(0.0, sum(self.window_times.values()) - median * len(self.window_times))
            if self.bus_bandwidth is not None:
                perf["bus_bandwidth_gbps"] = self.bus_bandwidth
            out["perf"] = perf
        out.update(self.kernels.results())
        return out


class PeakMemory:
    """What this run's training adds at its peak: the device's peak allocation, or the peak RSS above the start's
    (the torch import and earlier jobs of a pooled rank are not the run's)."""

    def __init__(self, device_kind: str, device: str) -> None:
        self.device_kind, self.device = device_kind, device
        if device_kind == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(device)
            self.kind, self.baseline = "device memory, peak allocated", 0
            return
        self.baseline = proc_bytes("VmRSS") or 0
        try:
            _reset_rss_peak()
            self.kind = "peak RSS growth of this run"
        except OSError:  # not Linux, or not permitted: the peak since the rank started
            self.kind = "peak RSS growth since the rank started"

    def restart(self) -> None:
        """Count the peak from now on (without clear_refs the RSS peak since the start stays)."""
        if self.device_kind == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "peak RSS growth of this run":
            _reset_rss_peak()

    def peak(self) -> int:
        if self.device_kind == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, (proc_bytes("VmHWM") or 0) - self.baseline)


def _reset_rss_peak() -> None:
    """Set the peak RSS (VmHWM) to the RSS of now; OSError where Linux's clear_refs is missing or not permitted."""
    with open(_CLEAR_REFS, "w") as fh:
        fh.write("5")


def proc_bytes(field: str, path: str = "/proc/self/status") -> int | None:
    """A size in kB from a /proc file (VmRSS, VmHWM; /proc/meminfo's MemAvailable), in bytes; None where none."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    """Every rank's results folded into one: the largest peak memory, every rank's host ops and kernels (a rank on
    another build, or with a fault of its own, must show in the inventory)."""
    merged: dict[str, Any] = {}
    for key, merge in _MERGES.items():
        found = [r.results[key] for r in records if key in r.results]
        if found:
            merged[key] = merge(found)
    return merged


def _merged_kernels(inventories: list[dict[str, Any]]) -> dict[str, Any]:
    union: dict[str, dict[str, Any]] = {}
    for inventory in inventories:
        add_inventory(union, inventory, calls=max)
    return dict(sorted(union.items()))


def _merged_host_ops(hosts: list[dict[str, Any]]) -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for host in hosts:
        add_host_ops(ops, host["ops"])
    return {"accelerator": hosts[0]["accelerator"], "ops": ops}


_MERGES: dict[str, Callable[[list[Any]], dict[str, Any]]] = {
    "kernels": _merged_kernels,
    "perf": lambda perfs: {**perfs[0], "peak_memory_bytes": max(p["peak_memory_bytes"] for p in perfs)},
    "host_ops": _merged_host_ops,
}
