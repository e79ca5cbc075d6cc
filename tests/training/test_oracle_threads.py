"""The float64 oracle runs as many threads as the CPUs its process may use, not as the machine has."""

from __future__ import annotations

import os

import pytest
import torch

from pytest_gpuregress.training import oracle
from pytest_gpuregress.training.seeding import usable_cpus


class Stop(Exception):
    """Ends float64_step0 once it has set its threads: the model is not the point here."""


def test_the_thread_count_follows_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank bound to 3 CPUs of a 64-CPU node (taskset, a Slurm cpuset) runs 3 threads, not 64."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == 3
    threads: list[int] = []

    def set_num_threads(count: int) -> None:
        threads.append(count)
        raise Stop

    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    with pytest.raises(Stop):
        oracle.float64_step0(None, {}, 0)
    assert threads == [3]


def test_without_an_affinity_mask_every_cpu_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert usable_cpus() == 12
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # "undetermined"
    assert usable_cpus() == 1


def test_a_failing_affinity_call_falls_back_to_the_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int) -> set[int]:
        raise OSError("sched_getaffinity: not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", refused, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert usable_cpus() == 8
