"""Which cases exist, survived -k and -m, and fit this run's ranks (plugin/selection.py), on a Selection built
directly from a Setup and a Platform: no pytest session, no rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.plugin import selection as selection_module  # its test_id is no test: not imported bare
from pytest_gpuregress.plugin.selection import Selection, _recorded_with
from pytest_gpuregress.scenarios import Setup, get_scenario
from pytest_gpuregress.stack.platforms import Platform
from pytest_gpuregress.training.model_specs import parse_model


def cpu_selection(world_size: int, asked: int | None = None, inject: list[str] | None = None,
                  models: tuple[str, ...] = ()) -> Selection:
    """A selection of the registered scenarios' cases for ``world_size`` gloo ranks on the CPU."""
    platform = Platform("cpu", "gloo", world_size, "cpu", "cpu", in_place=False)
    setup = Setup("cpu", "gloo", world_size, models=tuple(parse_model(m, Path.cwd()) for m in models))
    return Selection(setup, platform, asked, inject or [])


def test_a_cases_test_id_is_its_scenarios_name_then_its_own_id() -> None:
    """The pytest id of a case: ``fsdp`` for the scenario's own case, ``fsdp-bf16`` for another."""
    fsdp = get_scenario("fsdp")
    ids = [selection_module.test_id(fsdp, case) for case in fsdp.cases(cpu_selection(2).setup)]
    assert ids == ["fsdp", "fsdp-resume", "fsdp-bf16"]


def test_selecting_keeps_the_chosen_cases_that_fit_the_ranks() -> None:
    """At one rank a chosen case that needs two is not selected (it launches nothing); a direct call to run it is
    not applicable, naming the ranks it needs."""
    one = cpu_selection(1, asked=1)
    one.select({("checkpoint", "full-state-dict"), ("checkpoint", "sharded-2to1"), ("fsdp", "bf16")})
    assert {name: [c.id for c in cases] for name, cases in one.selected.items()} == \
        {"checkpoint": ["full-state-dict"], "fsdp": ["bf16"]}
    with pytest.raises(NotApplicable, match="needs 2 or more ranks: this run has 1"):
        one.runnable_case("checkpoint", "sharded-2to1")
    sc, case = one.runnable_case("checkpoint", "full-state-dict")
    assert (sc.name, case.id) == ("checkpoint", "full-state-dict")
    two = cpu_selection(2)
    two.select({("checkpoint", "sharded-2to1")})
    assert [c.id for c in two.selected["checkpoint"]] == ["sharded-2to1"]
    assert two.rank_shortfall(two.selected["checkpoint"][0]) is None


def test_the_header_at_one_rank_counts_the_cases_skipped_for_want_of_peers() -> None:
    """One line at one rank, whose count is every case needing two or more ranks; nothing at two ranks."""
    one = cpu_selection(1, asked=1)
    (line,) = one.rank_header()
    assert line.startswith("gpuregress single rank (--gpuregress-world-size=1): ")
    counted = int(re.search(r"; (\d+) cases that need 2 or more ranks are skipped", line).group(1))  # type: ignore[union-attr]
    assert counted == sum(case.min_ranks > 1 for _, case in one.all_cases()) > 0
    assert cpu_selection(2).rank_header() == []


def test_a_case_runs_in_the_launch_planned_with_the_cases_selected_beside_it() -> None:
    """fsdp's plain and resume cases share one launch, its bf16 case has its own; a launch no selected case uses
    serves every case of its scenario (another scenario's experiment runs it)."""
    selection = cpu_selection(2)
    fsdp = get_scenario("fsdp")
    selection.select({("fsdp", "fsdp"), ("fsdp", "resume"), ("fsdp", "bf16")})
    plain, resume, bf16 = selection.selected["fsdp"]
    assert selection.launch_of(fsdp, plain).key == selection.launch_of(fsdp, resume).key == "default"
    assert (selection.launch_of(fsdp, bf16).key, selection.launch_of(fsdp, bf16).config["dtype"]) == ("bf16", "bf16")
    assert [c.id for c in selection.served_cases(fsdp, "bf16")] == ["bf16"]
    selection.select(set())
    assert [c.id for c in selection.served_cases(fsdp, "default")] == ["fsdp", "resume", "bf16"]


def test_a_record_command_selects_only_the_cases_of_its_reference() -> None:
    """With a model given, ``gpuregress::fsdp*`` would also select the model's case, which reads another reference:
    the cases are then named one by one."""
    selection = cpu_selection(2, models=("tiny-moe",))
    assert selection.node_ids_for("fsdp") == ["gpuregress::fsdp", "gpuregress::fsdp-resume", "gpuregress::fsdp-bf16"]
    assert selection.node_ids_for("fsdp-tiny-moe") == ["gpuregress::fsdp-tiny-moe"]
    assert "fsdp-tiny-moe" in selection.reference_names()
    assert cpu_selection(2).node_ids_for("fsdp") == ["gpuregress::fsdp*"]  # without the model the pattern is exact


def test_a_reference_is_recorded_with_its_cases_and_the_cases_of_its_scenarios_that_read_none() -> None:
    """A scenario's cases that read no reference store into the one its other cases read (formats' decode cases
    into ``formats``); another scenario's case that reads none is not among them."""
    cases = [("formats", "formats-decode-e4m3fn", None), ("formats", "formats-behaviour-e4m3fn", "formats"),
             ("fsdp", "fsdp", "fsdp"), ("triage", "triage-oracle-fsdp", None)]
    assert _recorded_with("formats", cases) == ["formats-decode-e4m3fn", "formats-behaviour-e4m3fn"]
    assert _recorded_with("fsdp", cases) == ["fsdp"]
    assert _recorded_with("lora", cases) == []
