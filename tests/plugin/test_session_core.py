"""The session core tested directly, without pytester runs (#38 item 5): where references are read and recorded
(plugin/places.py), which cases are selected and which -k expression selects a reference's cases
(plugin/selection.py), a check case's judgement and who hears of it (plugin/pipeline.py), and the late window an
explanation runs (triage/explain.py). No rank starts."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.comparison.judgement import Judgement, JudgingPolicy
from pytest_gpuregress.errors import NotApplicable, RegressionFailure
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.resources import shipped_dir
from pytest_gpuregress.scenarios import get_scenario
from pytest_gpuregress.scenarios.comparator import Comparator
from pytest_gpuregress.scenarios.shared.resume_comparison import SAVED_KEY
from pytest_gpuregress.triage.explain import late_window

SHIPPED = shipped_dir("reference_runs")
PLATFORM = "cpu-gloo-w2-fp32"


def session(root: Path, **options: Any) -> GpuRegressSession:
    return GpuRegressSession(Options(enabled=True, device="cpu", **options), root, output_dir=root / "artifacts")


def reference_folder(root: Path, name: str, platform: str = PLATFORM) -> Path:
    """A reference folder as the store writes it: only its manifest matters to where one is found."""
    folder = root / name / platform
    folder.mkdir(parents=True)
    (folder / store.MANIFEST).write_text("{}")
    return folder


# --- places: where a reference is read and recorded ---------------------------------------------


def test_the_default_folder_is_read_first_and_the_shipped_references_are_its_fallback(tmp_path: Path) -> None:
    places = session(tmp_path).places
    assert places.location("fsdp", PLATFORM).path == SHIPPED / "fsdp" / PLATFORM  # none of the user's yet
    reference_folder(tmp_path / "reference_runs", "fsdp")
    assert places.location("fsdp", PLATFORM).path == tmp_path / "reference_runs" / "fsdp" / PLATFORM
    assert places.location("lora-none", PLATFORM).path == tmp_path / "reference_runs" / "lora-none" / PLATFORM
    assert {"fsdp", "lora-none"} <= places.used  # what the session looked for: never listed as unused


def test_an_explicit_folder_is_that_folder_only_and_printed_commands_never_record_into_the_shipped_one(tmp_path: Path) -> None:
    explicit = session(tmp_path, reference_dir=tmp_path / "refs").places
    assert explicit.location("fsdp", PLATFORM).path == tmp_path / "refs" / "fsdp" / PLATFORM  # no fallback
    inside_checkout = session(SHIPPED.parent).places  # the plugin's own checkout: its folder is the shipped one
    assert inside_checkout.recording_root == SHIPPED.with_name("reference_runs-recorded")
    # --gpuregress-record in the checkout writes its own references; a printed command points elsewhere (above)
    assert inside_checkout.location("fsdp", PLATFORM, for_writing=True).path == SHIPPED / "fsdp" / PLATFORM
    assert inside_checkout.elsewhere_root.name == "reference_runs-recorded-this-stack"


def test_the_record_command_carries_this_runs_setup(tmp_path: Path) -> None:
    places = session(tmp_path, steps=8, world_size=2, reference_dir=tmp_path / "refs").places
    command = shlex.split(places.record_hint(["gpuregress::fsdp"]))
    assert command[:4] == ["pytest", "--gpuregress", "--gpuregress-record", "gpuregress::fsdp"]
    assert {f"--gpuregress-reference-dir={tmp_path / 'refs'}", "--gpuregress-steps=8",
            "--gpuregress-world-size=2"} <= set(command)
    assert "--gpuregress-device=cpu" in command  # the device asked for; auto, the default, is left out


def test_recording_is_the_flag_or_a_missing_reference_with_record_missing(tmp_path: Path) -> None:
    assert session(tmp_path, record=True).places.recording("fsdp", PLATFORM)
    assert not session(tmp_path).places.recording("fsdp", PLATFORM)
    missing = session(tmp_path, record_missing=True, reference_dir=tmp_path / "refs").places
    assert missing.recording("fsdp", PLATFORM)
    reference_folder(tmp_path / "refs", "fsdp")
    assert not missing.recording("fsdp", PLATFORM)  # it never overwrites one


def test_unused_references_are_the_users_leftovers_on_this_runs_platforms(tmp_path: Path) -> None:
    refs = tmp_path / "refs"
    for name in ("fsdp", "fsdp-removed-model", "my-loop"):
        reference_folder(refs, name)
    reference_folder(refs, "fsdp-removed-model", "cuda-nccl-w8-bf16")
    places = session(tmp_path, reference_dir=refs).places
    places.location("my-loop", PLATFORM)  # a user's own loop read it this run
    assert places.unused({PLATFORM}) == ["fsdp-removed-model/cpu-gloo-w2-fp32"]
    assert session(SHIPPED.parent).places.unused({PLATFORM}) == []  # the shipped references are not the user's


# --- selection: which cases, and the node ids that select a reference's cases ------------------


def test_a_references_cases_are_selected_by_their_node_ids(tmp_path: Path) -> None:
    selection = session(tmp_path).selection
    assert selection.node_ids_for("fsdp") == ["gpuregress::fsdp*"]  # every id stored under it starts with it
    assert selection.node_ids_for("lora") == ["gpuregress::lora*"]
    assert {"fsdp", "lora", "checkpoint"} <= selection.reference_names()
    assert selection.node_ids_for("no-such-reference") == []


def test_a_projects_own_test_that_reads_a_reference_is_named_in_its_record_command(tmp_path: Path) -> None:
    places = session(tmp_path, reference_dir=tmp_path / "refs").places
    places.current_test = "tests/test_mine.py::test_my_mlp"
    places.location("my-mlp", PLATFORM)
    places.current_test = "gpuregress::triage-oracle-fsdp"  # a built-in case reading another's reference
    places.location("fsdp", PLATFORM)
    places.current_test = None  # between tests (the settings check before any runs)
    assert places.tests_reading("my-mlp") == ["tests/test_mine.py::test_my_mlp"]
    assert places.tests_reading("fsdp") == ["gpuregress::fsdp*"]
    assert "tests/test_mine.py::test_my_mlp" in shlex.split(places.location("my-mlp", PLATFORM).record_hint)


def test_selected_cases_carry_the_launches_and_a_case_is_looked_up_when_run_directly(tmp_path: Path) -> None:
    selection = session(tmp_path).selection
    selection.select({("fsdp", "fsdp"), ("fsdp", "resume")})
    assert [c.id for c in selection.selected["fsdp"]] == ["fsdp", "resume"]
    fsdp = get_scenario("fsdp")
    assert [c.id for c in selection.served_cases(fsdp, "default")] == ["fsdp", "resume"]  # one launch carries both
    sc, case = selection.runnable_case("fsdp", "bf16")  # not selected: found among all the scenario's cases
    assert (sc.name, case.id) == ("fsdp", "bf16")


def test_a_case_no_injected_fault_reaches_is_not_applicable(tmp_path: Path) -> None:
    selection = session(tmp_path, inject=("lora:mode=zero_lora_b",)).selection
    with pytest.raises(NotApplicable):
        selection.runnable_case("fsdp", "fsdp")


# --- pipeline: a check case's judgement ----------------------------------------------------------


class Judged(Comparator):
    """The default comparator, finding ``problems``."""

    def __init__(self, *problems: str) -> None:
        super().__init__(JudgingPolicy())
        self.problems = list(problems)

    def judge(self, reference: RunRecord | None, run: RunRecord) -> Judgement:
        return Judgement(comparison=None, problems=self.problems)


def check_record() -> RunRecord:
    return RunRecord(scenario="collectives", config={}, platform_key=PLATFORM, world_size=2, fingerprint={})


def test_a_check_case_tells_whether_its_own_checks_passed_apart_from_a_fault_that_never_fired(tmp_path: Path) -> None:
    pipeline = session(tmp_path).pipeline
    heard: list[bool] = []
    pipeline.check_without_reference(check_record(), "collectives-x", Judged(), [], judged=heard.append)
    with pytest.raises(RegressionFailure, match="fired 0 times"):  # only the fault's own failure: its checks passed
        pipeline.check_without_reference(check_record(), "collectives-y", Judged(), ["[fault] x fired 0 times"],
                                         judged=heard.append)
    with pytest.raises(RegressionFailure, match="wrong sum") as failed:
        pipeline.check_without_reference(check_record(), "collectives-z", Judged("wrong sum"), [], judged=heard.append)
    assert heard == [True, True, False]
    assert "reproduce the verdict: gpuregress compare" in str(failed.value)  # the failed run is kept, with its command


def test_the_session_tallies_the_sweep_for_other_verdicts(tmp_path: Path) -> None:
    core = session(tmp_path)
    collectives, fsdp = get_scenario("collectives"), get_scenario("fsdp")
    case = collectives.cases(core.setup)[0]
    core._tally(collectives, case, passed=True)
    core._tally(collectives, case, passed=False)
    core._tally(fsdp, fsdp.cases(core.setup)[0], passed=False)  # a training case speaks for no component
    (evidence,) = core._checks_evidence()
    assert (evidence.name, evidence.status, evidence.convicts) == ("collective sweep", "fails too", False)
    assert evidence.detail.startswith("1 of 2 of its cases failed") and ", first collectives-" in evidence.detail


# --- explain: the late window -------------------------------------------------------------------


def test_the_late_window_runs_where_the_reference_keeps_a_late_checkpoint(tmp_path: Path) -> None:
    core = session(tmp_path)
    fsdp = get_scenario("fsdp")
    case = next(c for c in fsdp.cases(core.setup) if c.id == "fsdp")
    plain = RunRecord(scenario="fsdp", config={}, platform_key=PLATFORM, world_size=2, fingerprint={})

    def never(*_: Any) -> RunRecord:
        raise AssertionError("no launch may start")

    assert late_window(fsdp, core.setup, never, plain, case, "exact", 2) == []  # no checkpoint: no window
    resume = next(c for c in fsdp.cases(core.setup) if c.id == "resume")
    assert late_window(fsdp, core.setup, never, plain, resume, "exact", 2) == []  # a resume case is its own window
    saved = RunRecord(scenario="fsdp", config={}, platform_key=PLATFORM, world_size=2, fingerprint={},
                      results={SAVED_KEY: {"step": 6}})
    (experiment,) = late_window(fsdp, core.setup, never, saved, case, "exact", 2)
    assert experiment.status == "not applicable" and "no resume checkpoint" in experiment.detail


def test_a_late_window_that_fails_to_run_keeps_the_other_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = session(tmp_path)
    fsdp = get_scenario("fsdp")
    case = next(c for c in fsdp.cases(core.setup) if c.id == "fsdp")
    saved = RunRecord(scenario="fsdp", config={}, platform_key=PLATFORM, world_size=2, fingerprint={},
                      results={SAVED_KEY: {"step": 6}})

    def crashed(*_: Any) -> RunRecord:
        raise RuntimeError("rank 1 raised OSError\nthe rest of its traceback")

    monkeypatch.setattr(type(fsdp), "from_reference", crashed)
    (experiment,) = late_window(fsdp, core.setup, crashed, saved, case, "exact", 2)
    assert (experiment.status, experiment.detail) == ("failed to run", "RuntimeError: rank 1 raised OSError")


# --- outcomes: the closing section's lines ------------------------------------------------------


def test_a_cases_summary_is_one_short_line_then_its_details_one_per_line() -> None:
    from pytest_gpuregress.plugin.outcomes import Outcome, outcome_lines

    long_path = "/a/long/folder/of/references/that/would/push/the/line/past/the/terminal/fsdp/cpu-gloo-w2-fp32"
    detail = (f"300 steps, loss 5.5571 -> 0.9426, clipping acted on 147 of 300 steps (max norm 0.5), reference "
              f"{long_path}; worst/limit (K x envelope + floor): loss 0.4x, grad_norm 0.2x; perf vs reference: step "
              "time 1.35x slower; kernels changed: 0; the stack changed (torch 2.12.0 -> 2.13.0), so results may move")
    lines = outcome_lines([Outcome("fsdp", PLATFORM, "passed", "tolerant", detail, ["a note"])])
    assert lines == [
        "fsdp cpu-gloo-w2-fp32: PASSED [tolerant lane] 300 steps, loss 5.5571 -> 0.9426, clipping acted on 147 of 300 "
        "steps (max norm 0.5)",
        f"    reference {long_path}",
        "    worst/limit (K x envelope + floor): loss 0.4x, grad_norm 0.2x",
        "    perf vs reference: step time 1.35x slower",
        "    kernels changed: 0",
        "    the stack changed (torch 2.12.0 -> 2.13.0), so results may move",
        "    note: a note",
    ]
    assert all(len(line) <= 160 for line in lines if not line.startswith("    reference"))
    (error,) = outcome_lines([Outcome("fsdp", PLATFORM, "error", "", "rank 1 raised OSError")])
    assert error == "fsdp cpu-gloo-w2-fp32: ERROR rank 1 raised OSError"
