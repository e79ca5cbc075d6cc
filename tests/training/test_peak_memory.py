"""The peak memory of a training run is the training's: the op trace of step 0 (its float64 digests, the
outputs it holds until the next op) is not counted. On the CPU: a fake torch.cuda memory API for the device
path, a fake /proc for the RSS path, and the real RSS of this process with the real tracer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.evidence import op_tracer
from pytest_gpuregress.training import observe

MIB = 1 << 20


class FakeCudaMemory:
    """torch.cuda's allocator statistics: what is allocated now, and the peak since the last reset."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self, device: object = None) -> int:
        return self.peak


def ctx_on(device_kind: str) -> SimpleNamespace:
    return SimpleNamespace(device_kind=device_kind, device="cuda:0" if device_kind == "cuda" else "cpu", profile=False,
                           progress=lambda text: None)


def run_steps(observer: observe.StepObserver, steps: int, alloc: object, free: object, tracer_bytes: int) -> None:
    """A training whose steps peak at 100 MiB on top of 50 MiB of weights and state; step 0 also traced,
    the trace's temporaries ``tracer_bytes`` on top of the step's activations."""
    alloc(50 * MIB)  # weights and optimizer state: held by every step
    for step in range(steps):
        with observer.step(step):
            alloc(100 * MIB)  # the step's activations and gradients
            if step == 0:
                alloc(tracer_bytes)  # a float64 copy of an output, digested
                free(tracer_bytes)
            free(100 * MIB)


def test_the_device_peak_leaves_out_the_op_traces_temporaries(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    observer = observe.StepObserver(ctx_on("cuda"), 8, tokens_per_step=64)
    run_steps(observer, 8, fake.alloc, fake.free, tracer_bytes=400 * MIB)
    observer.finish(world_size=1)
    assert fake.peak == 150 * MIB and observer.peak_bytes == 150 * MIB  # not 550 MiB: the trace's 400 are not the training's
    assert observer.results()["perf"]["peak_memory_bytes"] == 150 * MIB
    assert observer.results()["perf"]["memory"] == "device memory, peak allocated"


class FakeProc:
    """/proc/self/status's VmRSS and VmHWM, and clear_refs' reset of VmHWM to VmRSS."""

    def __init__(self, rss: int) -> None:
        self.rss = self.hwm = rss

    def alloc(self, nbytes: int) -> None:
        self.rss += nbytes
        self.hwm = max(self.hwm, self.rss)

    def free(self, nbytes: int) -> None:
        self.rss -= nbytes

    def status(self, field: str) -> int:
        return {"VmRSS": self.rss, "VmHWM": self.hwm}[field]

    def clear_refs(self) -> None:
        self.hwm = self.rss


def test_the_rss_peak_leaves_out_the_op_traces_temporaries(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = FakeProc(rss=300 * MIB)  # torch and the rank's earlier jobs: not the run's
    monkeypatch.setattr(observe, "proc_bytes", proc.status)
    monkeypatch.setattr(observe, "_reset_rss_peak", proc.clear_refs)
    observer = observe.StepObserver(ctx_on("cpu"), 8, tokens_per_step=64)
    run_steps(observer, 8, proc.alloc, proc.free, tracer_bytes=400 * MIB)
    observer.finish(world_size=1)
    assert observer.peak_bytes == 150 * MIB
    assert observer.results()["perf"]["memory"] == "peak RSS growth of this run"


def test_without_clear_refs_the_rss_peak_is_the_one_since_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the peak cannot be reset, the figure says so (its kind), and restarting it is no error."""
    proc = FakeProc(rss=300 * MIB)

    def refused() -> None:
        raise PermissionError("clear_refs")

    monkeypatch.setattr(observe, "proc_bytes", proc.status)
    monkeypatch.setattr(observe, "_reset_rss_peak", refused)
    observer = observe.StepObserver(ctx_on("cpu"), 8, tokens_per_step=64)
    run_steps(observer, 8, proc.alloc, proc.free, tracer_bytes=400 * MIB)
    observer.finish(world_size=1)
    assert observer.peak_bytes == 550 * MIB
    assert observer.results()["perf"]["memory"] == "peak RSS growth since the rank started"


def test_the_real_tracers_digests_are_not_in_this_processs_peak_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real OpTracer in step 0, its digests made to take 256 MiB each (as float64 copies of a large model's
    outputs would), against this process's own VmHWM: steps of 32 MiB peak far below."""
    try:
        observe._reset_rss_peak()
    except OSError:
        pytest.skip("no /proc/self/clear_refs here")
    real = op_tracer.digest_and_sketch

    def heavy(tensor: torch.Tensor) -> Any:
        scratch = np.ones(256 * MIB, dtype=np.uint8)  # touched: resident until freed (a mapping of its own)
        del scratch
        return real(tensor)

    monkeypatch.setattr(op_tracer, "digest_and_sketch", heavy)
    layer = torch.nn.Linear(16, 16)
    tracer = op_tracer.OpTracer(0, layer)
    observer = observe.StepObserver(ctx_on("cpu"), 8, tokens_per_step=64)
    for step in range(8):
        with observer.step(step):
            activations = np.ones(32 * MIB, dtype=np.uint8)
            with op_tracer.at_step(tracer, step).phase("forward"):
                layer(torch.ones(4, 16)).sum()
            op_tracer.at_step(tracer, step).finish()
            del activations
    observer.finish(world_size=1)
    assert tracer.error is None and tracer.finished
    assert observer.peak_bytes is not None and observer.peak_bytes < 160 * MIB, observer.peak_bytes
