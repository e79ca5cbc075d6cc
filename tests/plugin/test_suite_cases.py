"""The built-in suite (plugin/suite/cases.py): one pytest item per case under the node id ``gpuregress``, marked by
its scenario's kind, skipped with the reason where this run's ranks are too few, shown at its scenario's module, and
run through the session. Collected in-process (``--collect-only``), a stub session stands in for a run: no rank."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.plugin.suite import cases
from pytest_gpuregress.plugin.suite.cases import BuiltinCase, BuiltinSuite

ONE_CPU_RANK = ("--gpuregress", "--gpuregress-device=cpu", "--gpuregress-world-size=1", "-p", "no:cacheprovider")


@pytest.fixture
def collected(pytester: pytest.Pytester) -> dict[str, BuiltinCase]:
    """fsdp's cases and the checkpoint scenario's sharded ones at one CPU rank, by node id."""
    items, _ = pytester.inline_genitems(*ONE_CPU_RANK, "gpuregress::fsdp*", "gpuregress::checkpoint-sharded-*")
    return {item.nodeid: item for item in items}


def test_each_case_is_an_item_marked_by_kind_skipped_for_want_of_ranks_and_shown_at_its_scenario(
        collected: dict[str, BuiltinCase]) -> None:
    """Node ids as a user types them after ``gpuregress::``, each item holding its (scenario, case) under the suite;
    every case carries ``gpuregress`` and its kind's mark; at one rank a case needing two is skipped with the reason,
    never left out; a case is shown at its scenario's module (where a skip or failure points), the suite at this one."""
    assert sorted(collected) == ["gpuregress::checkpoint-sharded-1to2", "gpuregress::checkpoint-sharded-2to1",
                                 "gpuregress::fsdp", "gpuregress::fsdp-bf16", "gpuregress::fsdp-resume"]
    assert all(isinstance(item, BuiltinCase) for item in collected.values())
    assert collected["gpuregress::fsdp-bf16"].case == ("fsdp", "bf16")
    assert collected["gpuregress::checkpoint-sharded-2to1"].case == ("checkpoint", "sharded-2to1")

    def marks(node_id: str) -> set[str]:
        return {mark.name for mark in collected[node_id].iter_markers()}

    assert {"gpuregress", "gpuregress_training"} <= marks("gpuregress::fsdp")
    assert "gpuregress_check" not in marks("gpuregress::fsdp") and "skip" not in marks("gpuregress::fsdp-bf16")
    assert {"gpuregress", "gpuregress_check", "skip"} <= marks("gpuregress::checkpoint-sharded-2to1")
    (skip,) = collected["gpuregress::checkpoint-sharded-2to1"].iter_markers("skip")
    reason = skip.kwargs["reason"]
    assert reason.startswith("needs 2 or more ranks: this run has 1 (") and "(--gpuregress-world-size=1)" in reason

    scenarios = Path(cases.__file__).parents[2] / "scenarios"
    assert collected["gpuregress::fsdp"].reportinfo() == (str(scenarios / "fsdp" / "__init__.py"), 0, "gpuregress::fsdp")
    assert Path(collected["gpuregress::checkpoint-sharded-1to2"].reportinfo()[0]) == \
        scenarios / "checkpoint" / "__init__.py"
    suite = collected["gpuregress::fsdp"].parent
    assert isinstance(suite, BuiltinSuite) and suite.nodeid == "gpuregress"
    assert suite.reportinfo() == (cases.__file__, 0, "gpuregress")


def test_running_a_case_runs_it_through_the_session(collected: dict[str, BuiltinCase]) -> None:
    """runtest hands the session its (scenario, case id); a bug of ours shows from the case on, without pytest's
    frames above it."""
    ran: list[tuple[str, str]] = []
    item = collected["gpuregress::fsdp-resume"]
    item.parent.session_of = lambda: SimpleNamespace(run_case=lambda *case: ran.append(case))  # type: ignore[union-attr]
    item.runtest()
    assert ran == [("fsdp", "resume")]

    def broken(*_: Any) -> None:
        raise ValueError("a bug inside the plugin")

    item.parent.session_of = lambda: SimpleNamespace(run_case=broken)  # type: ignore[union-attr]
    with pytest.raises(ValueError) as excinfo:
        item.runtest()
    assert [entry.name for entry in item._traceback_filter(excinfo)] == ["broken"]


def test_a_kinds_mark_selects_only_its_cases(pytester: pytest.Pytester) -> None:
    """``-m gpuregress_training`` leaves the check scenarios' cases out: the marks select as any pytest mark."""
    result = pytester.runpytest_inprocess(*ONE_CPU_RANK, "--collect-only", "-q", "-m", "gpuregress_training",
                                          "gpuregress::fsdp", "gpuregress::checkpoint-tied")
    assert [line for line in result.outlines if line.startswith("gpuregress::")] == ["gpuregress::fsdp"]
