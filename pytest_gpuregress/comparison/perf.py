"""Throughput and memory against the reference, as ratios "worse by" (a step 1.6x as long, 0.6x the
bandwidth). Timings are noisy, so only medians over the steady steps are compared
(training/observe.py measures them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..reference.record import RunRecord
from ..units import human_bytes

PERF = "perf"
SLOWDOWN_LIMIT = 1.5
MEMORY_LIMIT = 1.3
MIN_STEADY_STEPS = 3
# Growth in peak memory below this is never a regression, whatever its ratio: the CPU's peak-RSS growth
# of a tiny model is a few MiB, and the allocator's noise alone moves it by several times.
MEMORY_FLOOR_BYTES = 64 << 20


@dataclass(frozen=True)
class Ratio:
    """One figure of this run against the reference's."""

    name: str
    reference: float
    current: float
    worse_by: float  # > 1: worse than the reference (slower, larger, less bandwidth)
    limit: float
    unit: str
    floor: float = 0.0  # how much worse, in the figure's unit, it must also be to count

    @property
    def over(self) -> bool:
        return self.worse_by > self.limit and abs(self.current - self.reference) > self.floor

    def describe(self) -> str:
        return (f"{self.name} {_value(self.current, self.unit)} vs {_value(self.reference, self.unit)} in the "
                f"reference: {self.worse_by:.2f}x {'worse' if self.worse_by >= 1 else 'better'}"
                + (f" (limit {self.limit:g}x)" if self.over else ""))

    def short(self) -> str:
        """In words: "step time 1.35x slower", "peak memory 1.10x smaller", "tokens/s unchanged"."""
        if round(self.worse_by, 2) == 1.0:
            return f"{self.name} unchanged"
        worse, better = _WORDS.get(self.unit, ("worse", "better"))
        if self.worse_by > 1:
            return f"{self.name} {self.worse_by:.2f}x {worse}"
        return f"{self.name} {1 / self.worse_by:.2f}x {better}"


# How each unit says worse and better: a slower step, fewer tokens/s (said as slower), more memory, less bandwidth.
_WORDS = {"s": ("slower", "faster"), "tokens/s": ("slower", "faster"), "bytes": ("larger", "smaller"),
          "GB/s": ("lower", "higher")}


def _value(value: float, unit: str) -> str:
    if unit == "bytes":
        return human_bytes(int(value))
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    return f"{value:.4g} {unit}"


# (field, name, unit, higher is better, which limit)
_FIGURES = (
    ("median_step_s", "step time", "s", False, "slowdown"),
    ("tokens_per_s", "tokens/s", "tokens/s", True, "slowdown"),
    ("peak_memory_bytes", "peak memory", "bytes", False, "memory"),
    ("bus_bandwidth_gbps", "all-reduce bus bandwidth", "GB/s", True, "slowdown"),
)
_FLOORS = {"memory": MEMORY_FLOOR_BYTES}  # per limit; none elsewhere


def ratios(reference: RunRecord, record: RunRecord, *, slowdown: float = SLOWDOWN_LIMIT,
           memory: float = MEMORY_LIMIT) -> list[Ratio] | None:
    """Every figure both records carry, as a ratio; None when either has no perf figures (an old reference)."""
    old, new = reference.results.get(PERF), record.results.get(PERF)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    if old.get("memory") != new.get("memory"):  # peak RSS against device memory means nothing
        old = {k: v for k, v in old.items() if k != "peak_memory_bytes"}
    limits = {"slowdown": slowdown, "memory": memory}
    out: list[Ratio] = []
    for key, name, unit, higher_is_better, limit in _FIGURES:
        a, b = _figure(old, key), _figure(new, key)
        if a is not None and b is not None:
            out.append(Ratio(name, a, b, a / b if higher_is_better else b / a, limits[limit], unit, _FLOORS.get(limit, 0.0)))
    return out


def _figure(figures: dict[str, Any], key: str) -> float | None:
    """A figure that can be compared: a number (a bool is none) not at or below 0."""
    value = figures.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)


def problems(found: list[Ratio] | None, record: RunRecord, reference: RunRecord | None = None) -> list[str]:
    """A finding per figure past its limit; none from a median of fewer
    than ``MIN_STEADY_STEPS`` steps on either side (a short run on a busy machine says nothing)."""
    steady = record.results.get(PERF, {}).get("steady_steps") or 0
    before = reference.results.get(PERF, {}).get("steady_steps", steady) if reference is not None else steady
    if min(steady, before or 0) < MIN_STEADY_STEPS:
        return []
    return [f"{r.describe()}; medians over {steady} steady steps" for r in _past_limits(found or [])]


def _past_limits(found: list[Ratio]) -> list[Ratio]:
    """The figures past their limits, one line per slowdown: tokens/s says it with the batch size, so the step
    time goes where both are past."""
    over = [r for r in found if r.over]
    if any(r.name == "tokens/s" for r in over):
        return [r for r in over if r.name != "step time"]
    return over


def summary(found: list[Ratio] | None) -> str:
    """For the closing table: "step time 1.02x slower, peak memory unchanged, ..." ("" without figures)."""
    return ", ".join(r.short() for r in found or [])
