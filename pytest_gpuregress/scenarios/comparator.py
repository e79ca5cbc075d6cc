"""One object that judges a case's runs, in the shape of syrupy's extensions.

``judge(reference or None, run)`` returns the findings and the verdict. The session, fail-fast, triage, plots
and ``gpuregress compare`` all use it, so a failure's printed command judges a kept run exactly as the test
did; a kept run carries ``judged_as`` (``describe``) for that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..comparison import failfast
from ..comparison.envelope import MetricLimits as Tolerances
from ..comparison.judgement import Judgement, JudgingPolicy
from ..comparison.observations import Observations
from ..errors import GpuRegressError
from ..evidence import clipping, collective_invariants, kernels
from ..findings import Problem
from ..reference.record import RunRecord
from .base import Case, Scenario, Setup

if TYPE_CHECKING:
    from ..comparison.compare import Comparison

JUDGED_AS = "judged_as"  # the key of a kept run's results that names what judged it


@dataclass
class Comparator:
    """Judges the runs of ``case`` of ``scenario`` under ``policy``; scenario None: a user's own run, compared
    on losses, gradients and weights (``gpuregress.check``)."""

    policy: JudgingPolicy
    scenario: Scenario | None = None
    case: Case | None = None
    setup: Setup | None = None
    tolerances: Tolerances | None = None  # a user's explicit limits (gpuregress.check_metrics): the tolerant lane's

    def own_checks(self, run: RunRecord) -> list[Problem]:
        """Findings that need no reference: the scenario's verdict, host ops of a GPU training run, and a training
        run's collectives and clip held to their own invariants."""
        out: list[Problem] = []
        if self.scenario is not None and self.case is not None and self.setup is not None:
            out += self.scenario.own_findings(self.case, run, self.setup)
        if self.scenario is None or self.scenario.kind == "training":
            # Every step: its collectives against their invariants across the ranks, its clip against its own norm.
            out += kernels.host_op_problems(run) + collective_invariants.problems(run.results) + clipping.problems(run)
        return out

    def row_label(self, reference_name: str) -> str:
        """What the closing table calls a judged run of reference ``reference_name``: the reference's name; a
        case that shares a reference but is a run of another kind (a resume) names itself."""
        return reference_name

    def compare(self, reference: RunRecord, run: RunRecord) -> Comparison:
        """The numeric comparison only: what triage's experiments and plots are judged by."""
        if self.scenario is not None and self.case is not None:
            return self.scenario.compare(reference, run, self.case, self.policy.lane)
        from ..comparison.compare import compare_training

        return compare_training(reference, run, lane=self.policy.lane, tolerances=self.tolerances)

    def judge(self, reference: RunRecord | None, run: RunRecord) -> Judgement:
        """The verdict on ``run``: its own checks, then (given a reference) the comparison and observations."""
        problems = self.own_checks(run)
        if reference is None:
            return Judgement(None, problems)
        stop = run.results.get("fail_fast")
        if stop:  # the run ended early: compare the steps it ran, and say where and why it stopped
            reference = failfast.truncated_reference(reference, run.steps)
            problems = [failfast.describe(stop), *problems]
        comparison = self.compare(reference, run)
        observed = Observations.of(reference, run, self.policy)
        comparison.kernel_changes = observed.kernel_changes
        return Judgement(comparison, [*problems, *observed.failures()], observed, reference)

    def watch(self, reference: RunRecord | None) -> dict[str, Any]:
        """What --gpuregress-fail-fast hands the ranks: the reference's values per step and their limits."""
        if reference is None:
            return failfast.watch_from(None, {})
        from ..comparison.compare import tolerant_limits

        return failfast.watch_from(reference, tolerant_limits(reference)[0])

    def describe(self) -> dict[str, Any]:
        """What a kept run stores to be judged again by ``gpuregress compare`` (see ``for_kept``)."""
        out: dict[str, Any] = {"policy": self.policy.to_json()}
        if self.tolerances is not None:
            out["tolerances"] = vars(self.tolerances)
        if self.scenario is not None and self.case is not None and self.setup is not None:
            setup = self.setup
            out.update(scenario=self.scenario.name, case=self.case.identity(),
                       setup={"device_kind": setup.device_kind, "backend": setup.backend, "world_size": setup.world_size,
                              "steps": setup.steps, "options": setup.options,
                              "tokens": None if setup.tokens is None else str(setup.tokens),
                              "models": [asdict(m) for m in setup.models]})
        return out


def comparator_of(scenario: Scenario, case: Case, setup: Setup, policy: JudgingPolicy) -> Comparator:
    """The scenario's comparator for ``case``: its own ``comparator_type`` where it declares one."""
    return (scenario.comparator_type or Comparator)(policy, scenario, case, setup)


def with_identity(run: RunRecord, comparator: Comparator) -> RunRecord:
    """``run`` with what judged it, for the copy kept in the artifacts folder (the run itself is not changed)."""
    return dataclasses.replace(run, results={**run.results, JUDGED_AS: comparator.describe()})


def for_kept(run: RunRecord, lane: str | None = None) -> Comparator:
    """The comparator that judged a kept run (``judged_as``), from the installed scenarios; ``lane`` overrides its lane.
    A run without ``judged_as`` (a reference) is judged as a user's own run: losses, gradients and weights."""
    described = run.results.get(JUDGED_AS) or {}
    policy = JudgingPolicy.from_json(described.get("policy", {}))
    if lane is not None:
        policy = JudgingPolicy(**{**policy.to_json(), "lane": lane})
    name = described.get("scenario")
    if name is None:
        limits = described.get("tolerances")
        return Comparator(policy, tolerances=Tolerances(**limits) if limits else None)
    from pathlib import Path

    from ..training.model_specs import ModelSpec
    from . import registry

    scenario = registry().get(name)
    if scenario is None:
        raise GpuRegressError(f"the run was judged by scenario {name!r}, which is not installed here "
                              f"(installed: {', '.join(registry())}); install the package that provides it")
    case, stored = described["case"], described["setup"]
    setup = Setup(**{**stored, "tokens": Path(stored["tokens"]) if stored.get("tokens") else None,
                     "models": tuple(ModelSpec(**m) for m in stored.get("models", ()))})
    return comparator_of(scenario, Case(**{**case, "marks": tuple(case.get("marks", ()))}), setup, policy)
