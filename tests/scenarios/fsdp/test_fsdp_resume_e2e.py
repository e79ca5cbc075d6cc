"""Resume across stacks end to end (fsdp-resume): the fsdp reference keeps its own checkpoint at step S, and a
comparison loads it on this machine's stack and trains on. Real gloo ranks, FSDP2, DCP in safetensors.

The session's fsdp reference (conftest.fsdp_reference, 8 steps) carries the checkpoint at step 6: clean, the
continuation repeats the reference's last 2 steps bit for bit; with one optimizer state dropped on load, the
piece is named; one element of a reduce-scatter off by 1e-5 from step 6 on, which the norms of the fsdp case
let through in the tolerant lane, fails the gradients of step 6 (``late_grad``), named a collective. A
reference without a checkpoint skips the case with the reason, a damaged one is refused
naming the file: neither starts a rank.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from ...conftest import FSDP_ONLY, FSDP_STEPS, reproduced, summary_of

pytestmark = pytest.mark.slow

PLATFORM = "cpu-gloo-w2-fp32"


def run(pytester: pytest.Pytester, refs: Path, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
                              f"--gpuregress-reference-dir={refs}", "-k", "fsdp-resume", "-rs", *extra)


def test_the_references_checkpoint_resumes_on_this_stack_bit_for_bit(pytester: pytest.Pytester,
                                                                       fsdp_reference: Path) -> None:
    resume = fsdp_reference / "fsdp" / PLATFORM / "resume"
    assert sorted(p.name for p in resume.iterdir()) == ["rng-rank0.json", "rng-rank1.json", "tensors", "trainer.json"]
    assert not [p for p in resume.rglob("*") if p.is_file() and not p.name.endswith((".json", ".safetensors"))]
    result = run(pytester, fsdp_reference)
    result.assert_outcomes(passed=1)
    # The row names the resume case, not the fsdp reference whose folder it shares.
    result.stdout.fnmatch_lines([f"fsdp-resume {PLATFORM}: PASSED [[]exact lane[]] 2 steps, *",
                                 "*note: fsdp-resume: the reference's checkpoint (step 6, written with torch *) loaded "
                                 "on this stack, trained on to step 8*"])


def test_one_optimizer_state_dropped_on_load_is_caught_and_named(pytester: pytest.Pytester,
                                                                 fsdp_reference: Path) -> None:
    result = run(pytester, fsdp_reference, "--gpuregress-inject=checkpoint:mode=optimizer_dropped")
    result.assert_outcomes(failed=1)
    saved = "after loading the reference's checkpoint is not the state it saved at step 6"
    result.stdout.fnmatch_lines([
        f"[[]checkpoint[]] resume: optimizer.exp_avg {saved} (21 of 21 tensors differ, first lm_head.weight)",
        f"[[]checkpoint[]] resume: optimizer.exp_avg_sq {saved} (21 of 21 tensors differ, first lm_head.weight)",
        f"[[]checkpoint[]] resume: optimizer.step {saved} (21 of 21 tensors differ, first lm_head.weight: 6.0 -> 1.0)",
        f"[[]checkpoint[]] resume: optimizer.param_groups {saved} (1 of 1 entries differ, first group0)",
        "[[]checkpoint[]] resumed at step 6 (steps counted from there): loss: first differing step 1 of 2:*"])
    out = result.stdout.str()
    assert f"resume: model {saved}" not in out and "rng." not in out  # what the load did restore is not named
    assert "triage" not in out  # triage reruns step 0, which a continuation never ran
    assert reproduced(out) == [1]  # the printed command judges the kept run the same way


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_a_one_element_fault_that_starts_late_fails_the_late_gradients_named_a_collective(
        pytester: pytest.Pytester, fsdp_reference: Path) -> None:
    late = "--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-5,from_step=6"
    norms_only = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
                                    f"--gpuregress-reference-dir={fsdp_reference}", "-k", FSDP_ONLY, late,
                                    "--gpuregress-lane=tolerant")
    norms_only.assert_outcomes(passed=1)  # what the fsdp case keeps after step 0 (norms) lets it through
    result = run(pytester, fsdp_reference, late, "--gpuregress-lane=tolerant")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["[[]collective[]] late_grad (step 6's gradients, from the reference's state) * "
                                 "* elements differ *"])
    clean = run(pytester, fsdp_reference, "--gpuregress-lane=tolerant")
    clean.assert_outcomes(passed=1)
    row = summary_of(clean.stdout.str(), f"fsdp-resume {PLATFORM}: PASSED [tolerant lane]")
    assert "worst/limit (K x envelope + floor): late_grad " in row, row


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_a_late_reduce_scatter_error_fails_the_fsdp_case_named_a_collective_by_the_late_window(
        pytester: pytest.Pytester, fsdp_reference: Path) -> None:
    # The default run's own case, the resume case deselected: step 0 is clean, so equivalence and the oracle clear
    # it, and the late window (step 6's gradients from the reference's checkpoint) convicts the reduce-scatter.
    late = "--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-3,from_step=6"
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
                                f"--gpuregress-reference-dir={fsdp_reference}", "-k", FSDP_ONLY, late)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "triage verdict: collective." in out and "Evidence: equivalence clean" in out, out[-5000:]
    late_step = re.search(r"late window differs: step (\d+)'s gradients, computed on this stack from the reference's "
                          r"own state", out)
    assert late_step is not None and late_step[1] == "6", out[-5000:]
    # Which gradient metric moves first at step 6 depends on the CPU's rounding (a nudge can leave the fp32 total norm
    # equal): any of them, named [collective], from step 6.
    result.stdout.fnmatch_lines(["[[]collective[]] *: first differing step 6*"])
    assert "[optimizer]" not in out and "AdamW implementation" not in out


@pytest.mark.full_tier  # the fast tier keeps the clean resume and the optimizer fault
def test_generators_left_unrestored_and_weights_applied_late_are_named(pytester: pytest.Pytester,
                                                                        fsdp_reference: Path) -> None:
    result = run(pytester, fsdp_reference, "--gpuregress-inject=checkpoint:mode=rng_not_restored",
                 "--gpuregress-inject=checkpoint:mode=weights_late")
    result.assert_outcomes(failed=1)
    saved = "after loading the reference's checkpoint is not the state it saved at step 6"
    result.stdout.fnmatch_lines([
        f"[[]checkpoint[]] resume: model {saved} (21 of 21 tensors differ, first lm_head.weight)",
        f"[[]checkpoint[]] resume: rng.python {saved} (2 of 2 ranks differ, first rank0)",
        f"[[]checkpoint[]] resume: rng.numpy {saved} (2 of 2 ranks differ, first rank0)",
        f"[[]checkpoint[]] resume: rng.torch_cpu {saved} (2 of 2 ranks differ, first rank0)"])
    assert "resume: optimizer." not in result.stdout.str()


@pytest.mark.full_tier  # the fast tier keeps the clean resume and the optimizer fault
def test_a_reference_without_a_checkpoint_skips_the_case_with_the_reason(pytester: pytest.Pytester,
                                                                         fsdp_reference: Path) -> None:
    refs = pytester.path / "refs"
    shutil.copytree(fsdp_reference, refs)
    folder = refs / "fsdp" / PLATFORM
    shutil.rmtree(folder / "resume")  # as a reference recorded before resume checkpoints existed
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("resume/")}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = run(pytester, refs)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not applicable: the reference has no resume checkpoint: re-record it: pytest "
                                 "--gpuregress --gpuregress-record 'gpuregress::fsdp[*]'*"])


@pytest.mark.full_tier  # the fast tier keeps the clean resume and the optimizer fault
def test_a_damaged_checkpoint_is_refused_naming_the_file(pytester: pytest.Pytester, fsdp_reference: Path) -> None:
    refs = pytester.path / "refs"
    shutil.copytree(fsdp_reference, refs)
    shard = next((refs / "fsdp" / PLATFORM / "resume" / "tensors").iterdir())
    shard.write_bytes(shard.read_bytes()[:-8])  # cut short, as a partial copy leaves it
    result = run(pytester, refs)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*CorruptReference: {shard}: sha256 * does not match manifest.json*"])
