"""Scenario ``triage``: the reference-free experiments of triage, as test cases of their own.

For every training scenario that supports triage, two cases: ``equivalence-<scenario>`` (N ranks
against one rank on the same global batch) and ``oracle-<scenario>`` (step 0 against float64).
They need no stored reference, so they also catch bugs on a brand-new platform. Select with
``-k equivalence`` or ``-k oracle``. The experiments themselves are in pytest_gpuregress/triage.
"""

from __future__ import annotations

from collections.abc import Callable

from ... import triage
from ...reference.record import RunRecord
from ..base import Case, CheckScenario, Launch, Scenario, Setup


class TriageScenario(CheckScenario):
    name = "triage"
    rank_entry = "pytest_gpuregress.training.oracle:run"  # never launched on its own: see experiment()

    def cases(self, setup: Setup) -> list[Case]:
        from .. import registry

        return [Case(f"{kind}-{sc.name}", data={"scenario": sc.name, "experiment": kind})
                for sc in registry().values() if sc.supports_triage for kind in ("equivalence", "oracle")]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        return []

    def experiment(self, case: Case, run: Callable[[Scenario, Launch], RunRecord], setup: Setup) -> RunRecord:
        from .. import registry

        target = registry()[case.data["scenario"]]
        found = {e.name: e for e in triage.cheap_evidence(target, setup, run)}[case.data["experiment"]]
        return RunRecord(scenario=self.name, config={}, platform_key="", world_size=setup.world_size,
                         results={"status": found.status, "detail": found.detail, "lines": found.lines,
                                  "component": found.component})

    def verdict(self, case: Case, record: RunRecord, setup: Setup) -> list[str]:
        result = record.results
        if result["status"] == "clean":
            return []
        return [f"[{result['component']}] {case.data['experiment']} of {case.data['scenario']}: {result['detail']}",
                *(f"    {line}" for line in result["lines"])]


SCENARIO = TriageScenario()
