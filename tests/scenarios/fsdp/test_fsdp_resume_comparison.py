"""The fsdp-resume verdict without ranks (scenarios/shared/resume_comparison.py, comparison/continuation.py): the load
judged piece by piece against what the reference saved, the continuation against the reference's last steps,
and the case's session side (skips with the reason, the comparator's view of the reference)."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.comparison.compare import Comparison
from pytest_gpuregress.comparison.continuation import from_step
from pytest_gpuregress.comparison.judgement import JudgingPolicy
from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.base import Launch, Setup
from pytest_gpuregress.scenarios.comparator import comparator_of
from pytest_gpuregress.scenarios.shared import late_gradients, resume_comparison
from pytest_gpuregress.scenarios.shared.state_pieces import differing
from pytest_gpuregress.triage.naming import name_findings

from ...conftest import make_record

START = 4


def named(compare: Callable[..., Comparison], *args: Any) -> Comparison:
    """A comparison with its findings named by triage, as the session reports it."""
    return name_findings(compare(*args))


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def boundary() -> dict[str, dict[str, str]]:
    """Digests as training/state_digests.py takes them: sha256 per tensor, the step count as it is."""
    return {"model": {"a.weight": sha("m1"), "b.weight": sha("m2")},
            "optimizer.exp_avg": {"a.weight": sha("e1"), "b.weight": sha("e2")},
            "optimizer.exp_avg_sq": {"a.weight": sha("s1"), "b.weight": sha("s2")},
            "optimizer.step": {"a.weight": "4.0", "b.weight": "4.0"},
            "optimizer.param_groups": {"group0": "g"}, "lr_scheduler": {"state": "l"},
            "rng.python": {"rank0": "p0", "rank1": "p1"}, "rng.numpy": {"rank0": "n0", "rank1": "n1"},
            "data.position": {"position": "4"}}


def reference() -> RunRecord:
    ref = make_record(steps=8)
    ref.arrays["envelope/loss"] = np.full(8, 1e-7)
    ref.arrays["envelope/param_grad_norm"] = np.full((8, 2), 1e-7)
    ref.arrays["envelope/step0_grad"] = np.full(2, 1e-7)
    ref.arrays["envelope/final_weights"] = np.full(2, 1e-7)
    ref.results = {resume_comparison.SAVED_KEY: {"step": START, "boundary": boundary(), "bytes": 1000}}
    return ref


def continuation(ref: RunRecord, loaded: dict[str, dict[str, str]] | None = None) -> RunRecord:
    """What a faithful resume from ``ref``'s checkpoint records: its steps START to the end, its final weights."""
    run = copy.deepcopy(ref)
    run.series = {k: v[START:] for k, v in ref.series.items()}
    run.arrays = {"param_grad_norm": ref.arrays["param_grad_norm"][START:].copy()}
    run.results = {resume_comparison.LOADED_KEY: {"step": START, "boundary": loaded or boundary()}}
    return run


def test_a_faithful_resume_passes_in_the_exact_lane() -> None:
    ref = reference()
    comparison = named(resume_comparison.compare, ref, continuation(ref), "auto")
    assert comparison.lane == "exact" and comparison.findings == []


def test_the_continuation_is_judged_against_the_references_last_steps_only() -> None:
    view = from_step(reference(), START)
    assert view.steps == 4 and view.arrays["param_grad_norm"].shape == (4, 2)
    assert view.arrays["envelope/loss"].shape == (4,) and view.arrays["envelope/final_weights"].shape == (2,)
    assert not [k for k in view.arrays if "step0" in k]  # step 0 is no part of a continuation
    with pytest.raises(ValueError, match="outside the reference's 8 steps"):
        from_step(reference(), 8)


def test_optimizer_state_dropped_on_load_is_named_piece_by_piece() -> None:
    ref = reference()
    loaded = boundary()
    loaded["optimizer.exp_avg"] = {"a.weight": sha("zeros"), "b.weight": sha("zeros")}
    loaded["optimizer.exp_avg_sq"] = {"a.weight": sha("zeros"), "b.weight": sha("zeros")}
    loaded["optimizer.step"] = {"a.weight": "1.0", "b.weight": "1.0"}
    run = continuation(ref, loaded)
    run.series["loss"][1] *= 1.01  # what a wrong optimizer state does to the next steps
    findings = named(resume_comparison.compare, ref, run, "auto").findings
    assert [(f.metric, f.tensor, f.step) for f in findings[:3]] == [
        ("resume_state", "optimizer.exp_avg", 4), ("resume_state", "optimizer.exp_avg_sq", 4),
        ("resume_state", "optimizer.step", 4)]
    whys = [why for _, why in differing(boundary(), loaded)]
    assert whys[:2] == ["2 of 2 tensors differ, first a.weight"] * 2 and whys[2].endswith(" a.weight: 4.0 -> 1.0")
    for finding, why in zip(findings[:3], whys):
        assert finding.message.startswith(f"resume: {finding.tensor} after loading the reference's ")
        assert finding.message.endswith(f" saved at step 4 ({why})"), finding.message
    curve = findings[3]
    assert (curve.metric, curve.step, curve.facts.get("after_broken_load")) == ("loss", 1, True)
    assert curve.message.startswith("resumed at step 4 ") and "first differing step 1" in curve.message
    assert {f.component for f in findings} == {"checkpoint"}  # the curve follows from the broken load


def test_a_generator_not_restored_is_named_with_its_rank() -> None:
    ref = reference()
    loaded = boundary()
    loaded["rng.numpy"] = {"rank0": "n0", "rank1": "scrambled"}
    [finding] = named(resume_comparison.compare, ref, continuation(ref, loaded), "auto").findings
    [(piece, why)] = differing(boundary(), loaded)
    assert piece == "rng.numpy" and why.startswith("1 of 2 ranks ") and why.endswith("rank1: n1 -> scrambled")
    assert (finding.metric, finding.tensor) == ("resume_state", piece) and finding.message.endswith(f"({why})")


def test_a_continuation_that_moved_on_a_sound_load_names_the_step_as_usual() -> None:
    ref = reference()
    run = continuation(ref)
    run.series["loss"][2] *= 1 + 1e-9
    [finding] = named(resume_comparison.compare, ref, run, "exact").findings
    assert finding.metric == "loss" and finding.step == 2 and finding.component != "checkpoint"
    assert finding.message.startswith("resumed at step 4 ") and "(steps counted from there)" in finding.message
    assert "first differing step 2 of 4" in finding.message and not finding.facts.get("after_broken_load")
    assert named(resume_comparison.compare, ref, run, "tolerant").findings == []  # 1e-9 is inside the envelope's limit


def test_a_load_that_failed_is_the_finding() -> None:
    ref = reference()
    run = continuation(ref)
    run.series, run.arrays, run.digests = {}, {}, {}
    run.results = {resume_comparison.LOADED_KEY: {"load_error": "CheckpointProblem: /r/resume/trainer.json: not JSON"}}
    [finding] = named(resume_comparison.compare, ref, run, "auto").findings
    assert finding.component == "checkpoint" and finding.message == (
        "resume: loading the reference's checkpoint (step 4) on this stack failed: CheckpointProblem: "
        "/r/resume/trainer.json: not JSON")


def test_the_comparator_judges_plots_and_keeps_against_the_references_last_steps() -> None:
    setup = Setup("cpu", "gloo", 2)
    fsdp = registry()["fsdp"]
    resume = {c.id: c for c in fsdp.cases(setup)}["resume"]
    comparator = comparator_of(fsdp, resume, setup, JudgingPolicy())
    ref = reference()
    judgement = comparator.judge(ref, continuation(ref))
    assert judgement.comparison is not None and judgement.comparison.passed
    assert judgement.reference is not None and judgement.reference.steps == 8 - START
    assert comparator_of(fsdp, fsdp.cases(setup)[0], setup, JudgingPolicy()).judge(ref, ref).reference is ref


def test_the_case_is_skipped_with_the_reason_where_it_cannot_run(tmp_path: Path) -> None:
    fsdp = registry()["fsdp"]
    resume = {c.id: c for c in fsdp.cases(Setup("cpu", "gloo", 2))}["resume"]

    def never(sc: object, launch: Launch) -> RunRecord:
        raise AssertionError("no launch for a case that cannot run")

    without = make_record(steps=8)
    with pytest.raises(NotApplicable, match=r"the reference has no resume checkpoint: re-record it: pytest --gpuregress "
                                            r"--gpuregress-record 'gpuregress::fsdp\*'"):
        fsdp.from_reference(resume, lambda: without, never, Setup("cpu", "gloo", 2))
    with pytest.raises(NotApplicable, match=r"on GPUs the resume checkpoint is optional .* about 1\.9 GB for the 156 "
                                            r"M-parameter model\): record and compare it with --gpuregress-resume-checkpoint"):
        fsdp.from_reference(resume, lambda: without, never, Setup("cuda", "nccl", 8))
    assert fsdp.from_reference(fsdp.cases(Setup("cpu", "gloo", 2))[0], lambda: without, never,
                               Setup("cpu", "gloo", 2)) is None  # the fsdp case runs as it always has


def test_the_resume_case_shares_the_fsdp_reference_and_is_not_triaged() -> None:
    fsdp = registry()["fsdp"]
    cases = {c.id: c for c in fsdp.cases(Setup("cpu", "gloo", 2))}
    assert fsdp.reference_name(cases["resume"]) == fsdp.reference_name(cases["fsdp"]) == "fsdp"
    assert not fsdp.triage_explains(cases["resume"]) and fsdp.triage_explains(cases["fsdp"])


def test_a_piece_the_reference_never_digested_is_not_judged_and_one_it_did_must_match() -> None:
    from pytest_gpuregress.scenarios.shared.state_pieces import differing

    saved = {"model": {"a": "1"}}
    newer = {"model": {"a": "1"}, "model.frozen": {"base": "2"}}  # this code digests a piece the reference lacks
    assert differing(saved, newer) == []
    with_frozen = {**saved, "model.frozen": {"base": "2"}}
    assert [p for p, _ in differing(with_frozen, {"model": {"a": "1"}, "model.frozen": {"base": "3"}})] == ["model.frozen"]
    assert [p for p, _ in differing(with_frozen, {"model": {"a": "1"}})] == ["model.frozen"]  # a piece not loaded


def _with_late_gradients(ref: RunRecord) -> tuple[RunRecord, RunRecord]:
    """``ref`` with the late gradients of step START and their envelope, and a faithful continuation that has them."""
    rng = np.random.default_rng(0)
    late = {"late_grad/a.weight": rng.normal(size=(16, 8)).astype(np.float32),
            "late_grad/b.weight": rng.normal(size=(8,)).astype(np.float32)}
    ref.arrays.update(late)
    ref.arrays[late_gradients.ENVELOPE] = np.full(2, 1e-7)
    run = continuation(ref)
    run.arrays.update({k: v.copy() for k, v in late.items()})
    return ref, run


def test_late_gradients_equal_pass_and_one_element_off_is_a_collective_named_at_the_checkpoints_step() -> None:
    ref, run = _with_late_gradients(reference())
    clean = named(resume_comparison.compare, ref, run, "tolerant")
    assert clean.passed and "late_grad" in clean.margins and "step0_grad" not in clean.margins
    run.arrays["late_grad/a.weight"][3, 5] += 1e-4  # one element of one tensor, as a corrupted reduce-scatter leaves it
    broken = named(resume_comparison.compare, ref, run, "tolerant")
    (finding,) = broken.findings
    assert (finding.metric, finding.component, finding.step, finding.tensor) == ("late_grad", "collective", START,
                                                                                 "a.weight")
    assert finding.message.startswith(f"late_grad (step {START}'s gradients, from the reference's state) a.weight "
                                      "[16, 8] = 128 elements: 1 elements differ")


def test_late_gradients_that_move_everywhere_are_a_kernel_and_a_reference_without_them_judges_the_curve_only() -> None:
    ref, run = _with_late_gradients(reference())
    run.arrays["late_grad/a.weight"] *= np.float32(1 + 1e-3)
    (finding,) = named(resume_comparison.compare, ref, run, "tolerant").findings
    assert (finding.metric, finding.component) == ("late_grad", "kernel")
    older = reference()  # recorded before late gradients: no late_grad margin, no finding from them
    assert "late_grad" not in named(resume_comparison.compare, older, continuation(older), "tolerant").margins


def test_a_late_replicas_spread_is_measured_as_step_0s_is() -> None:
    ref, run = _with_late_gradients(reference())
    run.arrays["late_grad/b.weight"][0] += np.float32(0.5)
    spread = late_gradients.spread(ref, [run])
    scale = float(np.abs(ref.arrays["late_grad/b.weight"]).max())
    assert spread[0] == 0.0 and spread[1] == pytest.approx(0.5 / scale, rel=1e-6)  # names in step0.names order


def test_recording_a_resume_case_keeps_its_cases_own_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume case records its case's own run as the reference: that run's own checks refuse a broken one, as the
    case's do. Only a continuation (a resume launch's record) skips them."""
    from pytest_gpuregress.findings import CheckFinding
    from pytest_gpuregress.scenarios.shared.resume_roles import RESULT_KEY

    setup = Setup("cpu", "gloo", 2)
    lora = registry()["lora"]
    own = type(lora).__mro__[2]  # the scenario's own class, under the resume wrapper
    broken = [CheckFinding("merge", "the merged model differs")]
    monkeypatch.setattr(own, "own_findings", lambda self, case, record, setup: broken)
    resume = next(c for c in lora.cases(setup) if c.id.endswith("-resume"))
    assert lora.own_findings(resume, make_record(), setup) == broken
    continued = make_record()
    continued.results[RESULT_KEY] = {"role": "continue"}
    assert lora.own_findings(resume, continued, setup) == []


def test_a_scenarios_own_comparator_keeps_judging_under_the_resume_wrapper() -> None:
    from pytest_gpuregress.scenarios.base import Scenario
    from pytest_gpuregress.scenarios.comparator import Comparator
    from pytest_gpuregress.scenarios.shared.resume_plan import ResumeComparator, ResumePlan, with_resume

    class Mine(Comparator):
        pass

    class Plugin(Scenario):
        name = "plugin"
        comparator_type = Mine

    plan = ResumePlan("plugin.rank:resume", "weights", resumes=lambda case: True)
    wrapped = with_resume(Plugin, plan)
    assert issubclass(wrapped.comparator_type, Mine) and issubclass(wrapped.comparator_type, ResumeComparator)
    assert with_resume(Scenario, plan).comparator_type is ResumeComparator
