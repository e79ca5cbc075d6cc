"""The part of the session's options a verdict depends on (``JudgingPolicy``). A kept run stores it, so that
``gpuregress compare`` judges the run again exactly as the plugin did. A leaf of comparison/: judgement.py and
observations.py both read it, without a circle between them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..kinds import GateMode, KernelChanges, LaneChoice


@dataclass(frozen=True)
class JudgingPolicy:
    """--gpuregress-lane, -kernel-changes, -perf, -perf-slowdown and -perf-memory."""

    lane: LaneChoice = "auto"
    kernel_changes: KernelChanges = "report"
    perf: GateMode = "warn"
    perf_slowdown: float = 1.5
    perf_memory: float = 1.3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JudgingPolicy:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # a newer version's extra keys: ignored
