"""What judging a run needs besides the reference and the run (a policy: policy.py), and what it gives (a judgement).

The policy is the part of the session's options a verdict depends on. A kept run stores it, so that
``gpuregress compare`` judges the run again exactly as the plugin did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..findings import Problem
from .policy import JudgingPolicy

if TYPE_CHECKING:
    from ..reference.record import RunRecord
    from .compare import Comparison
    from .observations import Observations


@dataclass
class Judgement:
    """One run judged: ``comparison`` against its reference (None for a check case), ``problems`` that fail it
    besides the comparison's findings (the scenario's own checks, host ops, a fail-fast stop, kernel or perf
    failures under the policy), and ``reference`` as compared (cut to a fail-fast run's steps)."""

    comparison: Comparison | None
    problems: list[Problem] = field(default_factory=list)
    observed: Observations | None = None
    reference: RunRecord | None = None

    @property
    def passed(self) -> bool:
        return not self.problems and (self.comparison is None or self.comparison.passed)


__all__ = ["Judgement", "JudgingPolicy"]
