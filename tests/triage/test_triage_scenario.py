"""The triage scenario (triage/scenario.py): triage's reference-free experiments as cases of their own, per training
scenario that composes triage and per --gpuregress-model; each case runs its experiment through the session's
runner (stand-in records here) and fails, naming the component, where the experiment convicts one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import Case, Launch, Scenario, Setup, registry
from pytest_gpuregress.training.model_specs import parse_model
from pytest_gpuregress.triage import ORACLE_ENTRY
from pytest_gpuregress.triage.scenario import SCENARIO, TriageScenario

from ..conftest import make_record

TWO_RANKS = Setup(device_kind="cpu", backend="gloo", world_size=2)
Runner = Callable[[Scenario, Launch], RunRecord]


def runner(launched: list[tuple[str, str]], n_grad_factor: float = 1.0, oracle_loss_factor: float = 1.0) -> Runner:
    """A stand-in for the session's runner: one synthetic record for every launch, which it notes (scenario, key);
    the N-rank run's step-0 gradient of a.weight times ``n_grad_factor``, the float64 oracle's loss times
    ``oracle_loss_factor``."""

    def run(sc: Scenario, launch: Launch) -> RunRecord:
        launched.append((sc.name, launch.key))
        record = make_record(config=launch.config)
        if launch.world_size is None:  # the N ranks of the platform
            record.arrays["step0_grad/a.weight"] = record.arrays["step0_grad/a.weight"] * n_grad_factor
        if launch.entry == ORACLE_ENTRY:
            record.series["loss"] = [record.series["loss"][0] * oracle_loss_factor]
        return record

    return run


def case(case_id: str, setup: Setup = TWO_RANKS) -> Case:
    return {c.id: c for c in SCENARIO.cases(setup)}[case_id]


def test_it_is_registered_by_its_entry_and_launches_nothing_itself() -> None:
    assert isinstance(registry()["triage"], TriageScenario) and registry()["triage"] is SCENARIO
    assert SCENARIO.launches(SCENARIO.cases(TWO_RANKS), TWO_RANKS) == []


def test_two_cases_per_triaged_scenario_equivalence_needing_two_ranks() -> None:
    """equivalence-<scenario> (N ranks against one: two ranks at least) and oracle-<scenario> (one rank), for
    every scenario that composes triage, in two families of the faults table, each with what it exercises."""
    triaged = [name for name, sc in registry().items() if sc.triage is not None]
    assert "fsdp" in triaged
    cases = SCENARIO.cases(TWO_RANKS)
    assert [c.id for c in cases] == [f"{kind}-{name}" for name in triaged for kind in ("equivalence", "oracle")]
    for c in cases:
        kind, name = c.id.split("-", 1)
        assert c.data == {"scenario": name, "experiment": kind, "model": None}
        assert (c.min_ranks, c.family) == ({"equivalence": 2, "oracle": 1}[kind], f"triage-{kind}")
        assert c.exercises is not None


def test_a_users_model_gets_cases_of_its_own(tmp_path: Path) -> None:
    """With --gpuregress-model, each scenario that trains users' models gets both cases for it too, named after it."""
    setup = Setup(device_kind="cpu", backend="gloo", world_size=2, models=(parse_model("tiny-moe", tmp_path),))
    ids = {c.id: c for c in SCENARIO.cases(setup)}
    assert {"equivalence-fsdp", "oracle-fsdp", "equivalence-fsdp-tiny-moe", "oracle-fsdp-tiny-moe"} <= set(ids)
    assert ids["oracle-fsdp-tiny-moe"].data == {"scenario": "fsdp", "experiment": "oracle", "model": "tiny-moe"}
    launched: list[tuple[str, str]] = []
    SCENARIO.experiment(ids["oracle-fsdp-tiny-moe"], runner(launched), setup)
    assert launched == [("fsdp", "triage-n-tiny-moe"), ("fsdp", "triage-1-tiny-moe"), ("fsdp", "triage-oracle-tiny-moe")]


@pytest.mark.parametrize("experiment", ["equivalence", "oracle"])
def test_a_clean_experiment_passes(experiment: str) -> None:
    """The scenario's three short launches run through the runner; agreeing records make a clean case."""
    launched: list[tuple[str, str]] = []
    c = case(f"{experiment}-fsdp")
    record = SCENARIO.experiment(c, runner(launched), TWO_RANKS)
    assert launched == [("fsdp", "triage-n"), ("fsdp", "triage-1"), ("fsdp", "triage-oracle")]
    assert record.scenario == "triage" and record.world_size == 2
    assert (record.results["status"], record.results["component"], record.results["lines"]) == ("clean", None, [])
    assert SCENARIO.own_findings(c, record, TWO_RANKS) == []


@pytest.mark.parametrize("experiment, component, changed", [
    ("equivalence", "collective", {"n_grad_factor": 1.01}),  # N ranks' step-0 gradient 1% off one rank's
    ("oracle", "kernel", {"oracle_loss_factor": 1.01}),  # one rank's step-0 loss 1% off float64
])
def test_a_convicting_experiment_fails_the_case_naming_the_component(experiment: str, component: str,
                                                                      changed: dict[str, float]) -> None:
    """The experiment's status, component and per-quantity lines are the record; the case's findings open with the
    component and the experiment, each line below them."""
    c = case(f"{experiment}-fsdp")
    record = SCENARIO.experiment(c, runner([], **changed), TWO_RANKS)
    assert (record.results["status"], record.results["component"]) == ("differs", component)
    lines = record.results["lines"]
    assert len(lines) == 1 and lines[0].startswith("a.weight" if experiment == "equivalence" else "step-0 loss")
    head, *rest = SCENARIO.own_findings(c, record, TWO_RANKS)
    assert head.startswith(f"[{component}] {experiment} of fsdp: ")
    assert rest == [f"    {line}" for line in lines]


def test_the_other_experiment_of_the_same_launches_stays_clean() -> None:
    """A case judges its own experiment only: the N-rank gradients off leave the oracle case clean, and the other
    way round (the oracle judges the one-rank run)."""
    assert SCENARIO.experiment(case("oracle-fsdp"), runner([], n_grad_factor=1.01), TWO_RANKS).results["status"] == "clean"
    assert SCENARIO.experiment(case("equivalence-fsdp"), runner([], oracle_loss_factor=1.01),
                               TWO_RANKS).results["status"] == "clean"
