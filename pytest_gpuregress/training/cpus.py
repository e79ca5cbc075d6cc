"""How many CPUs this process may use: what sizes the host-side thread pools (the float64 oracle, seeding)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (taskset, a batch scheduler's
    cpuset, a launcher's binding), else every CPU. More threads than that would only take turns on them."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1
