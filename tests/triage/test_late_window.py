"""The late window (triage/late_window.py): a divergence after a clean step 0 judged from the reference's own late
checkpoint, without launching ranks. The session side (the resume case's launch, run once for both cases) is
tests/scenarios/fsdp/test_fsdp_resume_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace

from pytest_gpuregress.comparison.compare import Comparison, Finding
from pytest_gpuregress.evidence import collective_invariants
from pytest_gpuregress.triage import Experiment, divergence_start, verdict
from pytest_gpuregress.triage.late_window import judged

from ..conftest import compare_named, make_record

CLEARED = [Experiment("equivalence", "clean", "x"), Experiment("oracle", "clean", "y")]


def late_divergence() -> Comparison:
    run = make_record()
    run.series["loss"] = run.series["loss"][:2] + [x * 1.01 for x in run.series["loss"][2:]]
    return compare_named(make_record(), run, lane="tolerant")


def window(*findings: Finding, lane: str = "exact") -> Comparison:
    return Comparison(lane, "same stack" if lane == "exact" else "another CPU", list(findings), {})


def late_grad(fraction: float) -> Finding:
    """Step 6's gradients wrong in ``fraction`` of their elements (a few: a collective's signature)."""
    return Finding("late_grad", "late_grad (step 6's gradients, from the reference's state) w: 2 elements "
                                           "differ", step=6, fraction=fraction)


def test_gradients_computed_wrong_from_the_reference_state_convict_their_component() -> None:
    experiment = judged(2, 6, window(late_grad(0.001), late_grad(0.001)))
    assert (experiment.status, experiment.component) == ("differs", "collective")
    assert "step 6's gradients" in experiment.detail and "own state at step 6" in experiment.detail
    assert "(and 1 more tensors)" in experiment.detail
    found = verdict(late_divergence(), [*CLEARED, experiment])
    component, line = found.component, found.line
    assert component == "collective" and "late window differs" in line


def test_a_dense_late_gradient_error_is_a_kernel_or_a_collective_which_one_window_cannot_tell_apart() -> None:
    component = verdict(late_divergence(), [*CLEARED, judged(2, 6, window(late_grad(0.9)))]).component
    assert component == "kernel or collective"


def test_a_reference_without_late_gradients_compares_nothing_and_clears_nothing() -> None:
    experiment = judged(2, 6, window(), compared=False)  # its gradients were never kept: "clean" would be false
    assert experiment.status == "not applicable" and "re-record it" in experiment.detail
    assert verdict(late_divergence(), [*CLEARED, experiment]).component is None


def test_right_gradients_and_a_divergence_that_recurs_in_a_fresh_process_convict_the_update() -> None:
    again = Finding("loss", "loss: first differing step 1 of 8 ...", step=1)  # the window counts from S
    experiment = judged(2, 6, window(again))
    assert experiment.status == "reproduced" and "go wrong in the update" in experiment.detail
    found = verdict(late_divergence(), [*CLEARED, experiment])
    component, line = found.component, found.line
    assert component == "optimizer" and "late window reproduced" in line and "Decided by rule" in line


def test_a_loss_that_moves_only_steps_after_the_right_update_says_what_else_could_do_it() -> None:
    """The helper's N3: the backward of one class's target wrong from step 233 on, while S = 225's batch has none of
    it: the window's loss moves at its step 9. A fresh-eyes fault, one device's silu after 40 calls, moves it at
    step 20. Neither is the update, which shows from the window's first step: the window convicts nothing, and the
    verdict says what would settle it (#53's known miss: such a late bug was named [optimizer])."""
    later = Finding("loss", "loss: first differing step 9 of 75 ...", step=9)
    experiment = judged(2, 6, window(later))
    assert experiment.status == "reproduced later" and experiment.component is None
    assert "only from the window's step 9" in experiment.detail
    found = verdict(late_divergence(), [*CLEARED, experiment])
    assert (found.component, found.rule) == (None, None) and "a run on the reference's own stack" in found.quoted


def test_a_window_that_leaves_its_limits_late_convicts_the_update_where_the_run_diverged_from_its_first_update() -> None:
    """A learning rate 0.1% off in the tolerant lane: the run diverges from step 1, right after a clean step 0, while
    the window's loss crosses its tolerant limit only at its step 5: the update, as in the exact lane."""
    late = Finding("loss", "loss: first differing step 5 of 75 ...", step=5)
    experiment = judged(1, 6, window(late, lane="tolerant"))
    assert (experiment.status, experiment.component) == ("reproduced", "optimizer")
    assert "from its first update on (step 1" in experiment.detail
    assert judged(2, 6, window(late, lane="tolerant")).component is None  # a later start: nothing
    # The exact lane: an update error moves the window's bits at its step 1, so a later move convicts nothing.
    assert judged(1, 6, window(late)).component is None


def test_a_divergence_that_does_not_recur_in_a_fresh_process_is_no_proof_against_the_collectives() -> None:
    """A bug that needs a warmed-up process (a buffer pool reused after 100 calls) is gone in a replay: right
    gradients at S and a clean continuation clear nothing, so the verdict stays inconclusive, never [optimizer]."""
    experiment = judged(2, 6, window())
    assert experiment.status == "did not reproduce" and "does not recur in a fresh process" in experiment.detail
    found = verdict(late_divergence(), [*CLEARED, experiment])
    component, line = found.component, found.line
    assert component is None and "inconclusive" in line and "late window did not reproduce" in line
    assert "what would settle it" in found.quoted and "needs a warmed-up process" in found.quoted  # the experiment
    flipped = Experiment("flip world size 1", "stayed", "worst deviation 30x -> 29x its limit")
    assert "what would settle it" not in verdict(late_divergence(), [*CLEARED, experiment, flipped]).quoted
    # The run's own collective invariants decide where they broke: in-run evidence, no replay needed.
    broke = Experiment("collective invariants", "broke", "step 4: all_gather call 9 ...", component="collective")
    assert verdict(late_divergence(), [*CLEARED, experiment, broke]).component == "collective"


def test_a_window_before_the_divergence_clears_nothing() -> None:
    experiment = judged(7, 6, window())
    assert experiment.status == "before the divergence" and "only at step 7" in experiment.detail
    found = verdict(late_divergence(), [*CLEARED, experiment])
    component, line = found.component, found.line
    assert component is None and "inconclusive" in line


def test_a_checkpoint_that_did_not_load_judges_the_load_not_the_divergence() -> None:
    broken = Finding("resume_state", "resume: optimizer state after loading ... is not the saved one")
    experiment = judged(2, 6, window(broken, late_grad(0.9)))
    assert experiment.status == "not applicable" and "did not load as saved" in experiment.detail
    assert verdict(late_divergence(), [*CLEARED, experiment]).component is None


def test_the_window_runs_only_where_step_0_is_cleared_and_a_later_step_differs() -> None:
    assert divergence_start(late_divergence(), CLEARED) == 2
    assert divergence_start(late_divergence(), [Experiment("equivalence", "not applicable", "x"), CLEARED[1]]) is None
    assert divergence_start(late_divergence(), CLEARED[:1]) is None
    step0 = make_record()
    step0.arrays["step0_grad/a.weight"] = step0.arrays["step0_grad/a.weight"] * 1.01
    assert divergence_start(compare_named(make_record(), step0, lane="tolerant"), CLEARED) is None


HELD = Experiment("collective invariants", "held", "40 calls (all_gather, reduce_scatter) checked across the ranks at "
                                                   "every step, every one kept its invariants")


def test_late_gradients_wrong_while_every_collective_kept_its_invariants_are_the_backwards() -> None:
    """The helper's N2: embedding_dense_backward drops the last row (one token id) from step 14 on. A few wrong
    elements read as a collective's signature, but the run's own ledger checked every reduce-scatter at every step
    and each kept its sums: the gradients were computed wrong before any collective carried them."""
    late = judged(2, 6, window(late_grad(0.001)))
    found = verdict(late_divergence(), [*CLEARED, late, HELD])
    component, line = found.component, found.line
    assert component == "kernel" and "late window differs" in line and "collective invariants held" in line
    # where the ledger did not see the gradients' collectives (DDP's C++ reducer), nothing clears them
    assert collective_invariants.held({collective_invariants.RESULT_KEY: {"calls": 9, "violated": 0,
                                                                          "ops": ["all_reduce"]}}) is None
    assert collective_invariants.held({collective_invariants.RESULT_KEY: {"calls": 9, "violated": 1,
                                                                          "ops": ["reduce_scatter"]}}) is None
    assert "9 calls (all_gather, reduce_scatter)" in str(collective_invariants.held(
        {collective_invariants.RESULT_KEY: {"calls": 9, "violated": 0, "ops": ["all_gather", "reduce_scatter"]}}))
    assert verdict(late_divergence(), [*CLEARED, late]).component == "collective"  # without the ledger: as before


def test_one_ranks_op_that_one_rank_replaying_every_micro_batch_also_computed_is_no_bad_device() -> None:
    """The helper's N1: nll_loss's backward wrong for one target id, which only rank 1's micro-batch holds at step 0.
    The op moved on rank 1 alone, but equivalence (one rank replaying each rank's micro-batch) computed the same:
    it followed the data, not the device. Without equivalence, or where it differs, rule one-rank names the device."""
    from pytest_gpuregress.triage.decision import Evidence, _one_rank

    entry = SimpleNamespace(op="aten::nll_loss_backward", outputs=("f32[512, 256]",))
    culprit = SimpleNamespace(entry=entry, world=2, also_on=(), site="compute", rank=1,
                              describe=lambda: "introduced at: aten::nll_loss_backward")
    comparison = SimpleNamespace(culprit=culprit, findings=[], paired_ops=None)
    assert _one_rank(Evidence(comparison, {})) is not None  # type: ignore[arg-type]
    differs = Experiment("equivalence", "differs", "rank 1's shard", component="collective")
    assert _one_rank(Evidence(comparison, {"equivalence": differs}))[0] == "device"  # type: ignore[arg-type,index]
    clean = Experiment("equivalence", "clean", "2 ranks and 1 rank agree")
    assert _one_rank(Evidence(comparison, {"equivalence": clean})) is None  # type: ignore[arg-type]

