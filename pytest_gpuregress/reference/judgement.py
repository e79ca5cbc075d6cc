"""What judging a run needs besides the reference and the run (a policy), and what it gives (a judgement).

The policy is the part of the session's options a verdict depends on. A kept run stores it, so that
``gpuregress compare`` judges the run again exactly as the plugin did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compare import Comparison
    from .observations import Observations
    from .record import RunRecord


@dataclass(frozen=True)
class JudgingPolicy:
    """--gpuregress-lane, -kernel-changes, -perf, -perf-slowdown and -perf-memory."""

    lane: str = "auto"  # auto | exact | tolerant
    kernel_changes: str = "report"  # report | fail | off
    perf: str = "warn"  # warn | fail | off
    perf_slowdown: float = 1.5
    perf_memory: float = 1.3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JudgingPolicy:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # a newer version's extra keys: ignored


@dataclass
class Judgement:
    """One run judged.

    ``comparison``: against its reference (None where the case has none: a check case).
    ``problems``: complete messages that fail it besides the comparison's findings: the scenario's own checks
    (LoRA, formats, checkpoint), ops on the host, a fail-fast stop, kernel or perf failures under the policy.
    ``reference``: the reference as compared (cut to the steps a fail-fast run ran)."""

    comparison: Comparison | None
    problems: list[str] = field(default_factory=list)
    observed: Observations | None = None
    reference: RunRecord | None = None

    @property
    def passed(self) -> bool:
        return not self.problems and (self.comparison is None or self.comparison.passed)
