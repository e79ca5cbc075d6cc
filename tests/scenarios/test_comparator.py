"""The one object that judges a case's runs: what a kept run stores of it, and how ``gpuregress compare`` gets it
back. End to end, the printed commands fail and pass kept runs in tests/scenarios/formats/test_formats_e2e.py,
test_lora_e2e.py and test_checkpoint_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuregress.cli import main
from pytest_gpuregress.comparison.judgement import JudgingPolicy
from pytest_gpuregress.errors import GpuRegressError
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.reference import store
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.comparator import JUDGED_AS, Comparator, comparator_of, for_kept, with_identity

from ..conftest import make_record


def _formats_comparator() -> Comparator:
    session = GpuRegressSession(Options(enabled=True, device="cpu", lane="tolerant", perf="fail"), Path.cwd())
    scenario = registry()["formats"]
    case = next(c for c in scenario.cases(session.setup) if c.id == "behaviour-e4m3fn")
    return comparator_of(scenario, case, session.setup, session.policy)


def test_a_kept_run_names_its_scenario_case_setup_and_policy_and_gets_them_back() -> None:
    comparator = _formats_comparator()
    record = make_record()
    kept = with_identity(record, comparator)
    assert JUDGED_AS not in record.results  # the run itself is not changed
    again = for_kept(kept)
    assert again.scenario is registry()["formats"] and again.case == comparator.case
    assert again.setup == comparator.setup and again.policy == JudgingPolicy(lane="tolerant", perf="fail")
    assert for_kept(kept, lane="exact").policy.lane == "exact"  # --lane overrides the stored lane


def test_a_record_without_a_judge_is_compared_as_a_training_run() -> None:
    comparator = for_kept(make_record())
    assert comparator.scenario is None and comparator.policy == JudgingPolicy()
    assert comparator.judge(make_record(), make_record()).passed
    assert not comparator.judge(make_record(), make_record(seed=1)).passed


def test_a_run_judged_by_a_scenario_not_installed_here_is_a_clear_error() -> None:
    kept = with_identity(make_record(), _formats_comparator())
    kept.results[JUDGED_AS]["scenario"] = "not-installed"
    with pytest.raises(GpuRegressError, match="scenario 'not-installed', which is not installed here"):
        for_kept(kept)


def test_compare_without_the_reference_a_run_needs_says_how_to_call_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = store.write_reference(store.ReferenceLocation(tmp_path, "fsdp", "cpu-gloo-w2-fp32"), make_record(), overwrite=False)
    assert main(["compare", str(run)]) == 2
    assert f"is judged against a reference: gpuregress compare REFERENCE {run}" in capsys.readouterr().err


def test_references_no_case_reads_are_listed_and_read_ones_are_not(tmp_path: Path) -> None:
    for name in ("fsdp", "fsdp-removed-model", "lora"):
        store.write_reference(store.ReferenceLocation(tmp_path, name, "cpu-gloo-w2-fp32"), make_record(), overwrite=False)
    store.write_reference(store.ReferenceLocation(tmp_path, "old", "cuda-nccl-w8-bf16"), make_record(), overwrite=False)
    session = GpuRegressSession(Options(enabled=True, device="cpu", reference_dir=tmp_path), tmp_path)
    # Another platform's references are not this run's to judge; lora's is read by its cases.
    assert session.places.unused({"cpu-gloo-w2-fp32"}) == ["fsdp-removed-model/cpu-gloo-w2-fp32"]
    # A user's own loop reads a reference by its own name: once read, it is not listed as unread.
    session.places.location("fsdp-removed-model", "cpu-gloo-w2-fp32")
    assert session.places.unused({"cpu-gloo-w2-fp32"}) == []
