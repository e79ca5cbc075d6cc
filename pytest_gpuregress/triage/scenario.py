"""Scenario ``triage``: the reference-free experiments of triage, as test cases of their own.

Per training scenario ``equivalence-<scenario>`` and ``oracle-<scenario>`` (plus one per --gpuregress-model);
they need no reference, so they also catch bugs on a brand-new platform. It lives above the scenarios because
it runs them (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

from ..reference.record import RunRecord
from ..scenarios import registry
from ..scenarios.base import Case, CheckScenario, Launch, Scenario, Setup
from ..scenarios.shared.exercised import trained
from . import cheap_evidence, model_suffix


class TriageScenario(CheckScenario):
    name = "triage"
    rank_entry = "pytest_gpuregress.training.oracle:run"  # never launched on its own: see experiment()

    def cases(self, setup: Setup) -> list[Case]:
        cases = []
        for sc in (sc for sc in registry().values() if sc.triage is not None):
            models = [None, *(m.name for m in setup.models)] if sc.trains_user_models else [None]
            # Equivalence at one rank would compare one rank with one rank: it needs two.
            # Both rerun the scenario's training from step 0 in fp32 (the oracle's stack run on one rank).
            adamw = str(sc.default_config(setup).get("adamw", "fused"))
            cases += [Case(f"{kind}-{sc.name}{model_suffix(model)}",
                           data={"scenario": sc.name, "experiment": kind, "model": model}, min_ranks=min_ranks,
                           exercises=trained(setup, adamw=adamw, bf16=False, model=model),
                           family=f"{self.name}-{kind}")
                      for model in models for kind, min_ranks in (("equivalence", 2), ("oracle", 1))]
        return cases

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        return []

    def experiment(self, case: Case, run: Callable[[Scenario, Launch], RunRecord], setup: Setup) -> RunRecord:
        target = registry()[case.data["scenario"]]
        evidence = cheap_evidence(target, setup, run, case.data.get("model"))
        found = {e.name: e for e in evidence}[case.data["experiment"]]
        return RunRecord(scenario=self.name, config={}, platform_key="", world_size=setup.world_size,
                         results={"status": found.status, "detail": found.detail, "lines": found.lines,
                                  "component": found.component})

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[str]:
        result = record.results
        if result["status"] == "clean":
            return []
        return [f"[{result['component']}] {case.data['experiment']} of {case.data['scenario']}: {result['detail']}",
                *(f"    {line}" for line in result["lines"])]


SCENARIO = TriageScenario()
