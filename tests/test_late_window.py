"""The late window (triage/late_window.py): a divergence after a clean step 0 judged from the reference's own late
checkpoint, without launching ranks. The session side (the resume case's launch, run once for both cases) is
tests/test_fsdp_resume_e2e.py's."""

from __future__ import annotations

from pytest_gpuregress.reference.compare import Comparison, Finding, compare_training
from pytest_gpuregress.triage import Experiment, divergence_start, verdict
from pytest_gpuregress.triage.late_window import judged

from .conftest import make_record

CLEARED = [Experiment("equivalence", "clean", "x"), Experiment("oracle", "clean", "y")]


def late_divergence() -> Comparison:
    run = make_record()
    run.series["loss"] = run.series["loss"][:2] + [x * 1.01 for x in run.series["loss"][2:]]
    return compare_training(make_record(), run, lane="tolerant")


def window(*findings: Finding) -> Comparison:
    return Comparison("exact", "same stack", list(findings), {})


def late_grad(component: str) -> Finding:
    return Finding("late_grad", component, "late_grad (step 6's gradients, from the reference's state) w: 2 elements "
                                           "differ", step=6)


def test_gradients_computed_wrong_from_the_reference_state_convict_their_component() -> None:
    experiment = judged(2, 6, window(late_grad("collective"), late_grad("collective")))
    assert (experiment.status, experiment.component) == ("differs", "collective")
    assert "step 6's gradients, computed on this stack from the reference's own state at step 6" in experiment.detail
    assert "(and 1 more tensors)" in experiment.detail
    component, line = verdict(late_divergence(), [*CLEARED, experiment])
    assert component == "collective" and "late window differs" in line


def test_a_dense_late_gradient_error_is_a_kernel_or_a_collective_which_one_window_cannot_tell_apart() -> None:
    component, _ = verdict(late_divergence(), [*CLEARED, judged(2, 6, window(late_grad("kernel")))])
    assert component == "kernel or collective"


def test_a_reference_without_late_gradients_compares_nothing_and_clears_nothing() -> None:
    experiment = judged(2, 6, window(), compared=False)  # its gradients were never kept: "clean" would be false
    assert experiment.status == "not applicable" and "re-record it" in experiment.detail
    assert verdict(late_divergence(), [*CLEARED, experiment])[0] is None


def test_right_gradients_and_a_divergence_that_recurs_in_a_fresh_process_convict_the_update() -> None:
    again = Finding("loss", "optimizer", "loss: first differing step 7 of 8 ...", step=7)
    experiment = judged(2, 6, window(again))
    assert experiment.status == "reproduced" and "go wrong in the update" in experiment.detail
    component, line = verdict(late_divergence(), [*CLEARED, experiment])
    assert component == "optimizer" and "late window reproduced" in line and "Decided by rule" in line


def test_a_divergence_that_does_not_recur_in_a_fresh_process_is_no_proof_against_the_collectives() -> None:
    """A bug that needs a warmed-up process (a buffer pool reused after 100 calls) is gone in a replay: right
    gradients at S and a clean continuation clear nothing, so the verdict stays inconclusive, never [optimizer]."""
    experiment = judged(2, 6, window())
    assert experiment.status == "did not reproduce" and "does not recur in a fresh process" in experiment.detail
    component, line = verdict(late_divergence(), [*CLEARED, experiment])
    assert component is None and "inconclusive" in line and "late window did not reproduce" in line
    # The run's own collective invariants decide where they broke: in-run evidence, no replay needed.
    broke = Experiment("collective invariants", "broke", "step 4: all_gather call 9 ...", component="collective")
    assert verdict(late_divergence(), [*CLEARED, experiment, broke])[0] == "collective"


def test_a_window_before_the_divergence_clears_nothing() -> None:
    experiment = judged(7, 6, window())
    assert experiment.status == "before the divergence" and "only at step 7" in experiment.detail
    component, line = verdict(late_divergence(), [*CLEARED, experiment])
    assert component is None and "inconclusive" in line


def test_a_checkpoint_that_did_not_load_judges_the_load_not_the_divergence() -> None:
    broken = Finding("resume_state", "checkpoint", "resume: optimizer state after loading ... is not the saved one")
    experiment = judged(2, 6, window(broken, late_grad("kernel")))
    assert experiment.status == "not applicable" and "did not load as saved" in experiment.detail
    assert verdict(late_divergence(), [*CLEARED, experiment])[0] is None


def test_the_window_runs_only_where_step_0_is_cleared_and_a_later_step_differs() -> None:
    assert divergence_start(late_divergence(), CLEARED) == 2
    assert divergence_start(late_divergence(), [Experiment("equivalence", "not applicable", "x"), CLEARED[1]]) is None
    assert divergence_start(late_divergence(), CLEARED[:1]) is None
    step0 = make_record()
    step0.arrays["step0_grad/a.weight"] = step0.arrays["step0_grad/a.weight"] * 1.01
    assert divergence_start(compare_training(make_record(), step0, lane="tolerant"), CLEARED) is None
