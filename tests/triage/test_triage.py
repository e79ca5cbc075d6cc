"""Triage end to end: each fault is pinned on the right component by experiments, and a clean run passes.

They compare with the session's short fsdp reference (8 steps, conftest.py), recorded once for every test file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RS_1E4 = "collective:op=reduce_scatter,max_bytes=200000,mode=nudge,rel=1e-4"


@pytest.fixture
def refs(fsdp_reference: Path) -> Path:
    """The session's 8-step fsdp reference (conftest.py), read only: one recording less for the fast tier."""
    return fsdp_reference


def run(pytester: pytest.Pytester, refs: Path, selection: str, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-steps=8",
                              f"--gpuregress-reference-dir={refs}", "-k", selection, *extra)


def test_clean_run_passes_equivalence_and_oracle(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "triage")
    result.assert_outcomes(passed=2)


@pytest.mark.full_tier  # the switch flips: the fast tier convicts a collective by equivalence alone (rank 1 below)
def test_reduce_scatter_error_is_convicted_as_collective_by_equivalence_and_switches(
    pytester: pytest.Pytester, refs: Path
) -> None:
    started = time.monotonic()
    result = run(pytester, refs, "fsdp and not resume and not bf16", f"--gpuregress-inject={RS_1E4}", "--gpuregress-triage", "-rf")
    elapsed = time.monotonic() - started
    result.assert_outcomes(failed=2, passed=1)  # fsdp and its equivalence case fail; the oracle is clean
    out = result.stdout.str()
    assert "triage verdict: collective." in out and "Evidence: equivalence differs: 2 ranks" in out
    assert "differ from 1 rank at step 0" in out
    assert "oracle clean" in out
    result.stdout.fnmatch_lines(["*equivalence: model.norm.weight [[]64[]]: 2 elements beyond * carried by "
                                 "reduce-scatter of the root group, 128.2 KiB*"])
    assert "[collective] step0_grad" in out and "[kernel]" not in out
    # The switches: one rank has no collective to corrupt, so the deviation vanishes there.
    assert "flip world size 1 vanished" in out
    assert "flip one thread per rank not applicable" in out
    assert "FAILED gpuregress::triage-oracle" not in out
    print(f"--gpuregress-triage on one failing 8-step scenario: {elapsed:.0f}s")


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_linear_layer_noise_is_convicted_as_kernel_by_the_oracle(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "fsdp and not resume and not bf16", "--gpuregress-inject=linear_noise:rel=1e-4")
    out = result.stdout.str()
    assert "triage verdict: kernel." in out and "Evidence: equivalence clean" in out, out[-3000:]
    assert "oracle differs: step 0 differs from" in out
    result.stdout.fnmatch_lines(["*[[]kernel[]] oracle of fsdp: step 0 differs from float64*"])
    assert "FAILED gpuregress::triage-equivalence" not in out


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_a_gemm_bug_of_the_per_rank_shape_is_a_kernel_not_a_collective(pytester: pytest.Pytester, refs: Path) -> None:
    # Each rank's GEMMs have 8 x 64 = 512 rows. A one-rank run over the whole batch (1024 rows) would call another
    # kernel, stay clean, and equivalence would convict a collective; the one rank runs each rank's micro-batch.
    for flips in ((), ("--gpuregress-triage",)):  # the world-size flip runs each rank's micro-batch too
        result = run(pytester, refs, "fsdp and not resume and not bf16", "--gpuregress-inject=linear_noise:rel=1e-4,rows=512",
                     *flips)
        out = result.stdout.str()
        assert "triage verdict: kernel." in out and "Evidence: equivalence clean" in out, out[-3000:]
        assert "oracle differs: step 0 differs from" in out and "float64" in out
        assert "[collective]" not in out and "FAILED gpuregress::triage-equivalence" not in out


@pytest.mark.full_tier  # end to end with spawned ranks, and the switch flips
def test_a_gemm_bug_of_one_projection_width_is_a_kernel_that_depends_on_the_shape_with_the_flips(
        pytester: pytest.Pytester, refs: Path) -> None:
    # Only GEMMs with 176 output features (gate_proj, up_proj) go wrong, as a kernel picked by N would: the op trace
    # sees the same op right at the other widths on unmoved inputs, and the world-size flip keeps each rank's shapes.
    result = run(pytester, refs, "fsdp and not resume and not bf16", "--gpuregress-inject=linear_noise:rel=1e-4,features=176",
                 "--gpuregress-triage")
    out = result.stdout.str()
    assert "triage verdict: kernel." in out and "Evidence: equivalence clean" in out, out[-5000:]
    assert "    depends on the shape: aten::mm" in out and "at f32[512, 64] x f32[64, 176]" in out
    assert "f32[512, 64] x f32[64, 64]" in out.split("and none at", 1)[1].splitlines()[0]
    assert "[collective]" not in out


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_the_collective_sweep_of_the_same_session_is_the_verdicts_evidence(pytester: pytest.Pytester,
                                                                          refs: Path) -> None:
    # The root group's reduce-scatter message only (131328 bytes): the sweep's messages (131072 bytes the nearest) stay right, so
    # the verdict says the collective is convicted although the sweep passed, and what the sweep does not vary.
    fault = "collective:op=reduce_scatter,min_bytes=131200,max_bytes=131400,mode=nudge,rel=1e-3"
    result = run(pytester, refs, "(fsdp and not resume and not bf16 and not triage) or "
                                 "(collectives and reduce_scatter and fp32)", f"--gpuregress-inject={fault}")
    out = result.stdout.str()
    assert "triage verdict: collective." in out and "Evidence: equivalence differs" in out, out[-5000:]
    assert "collective sweep clean: its " in out and " cases passed in this session" in out
    assert "would need what they do not vary" in out and "(this run's message sizes" in out
    # The sweep's cases fail only for the fault that never fired in them: their own checks passed, and count so.
    # (Counted from the outcomes, not the messages: under -vv pytest prints each message twice.)
    swept = int(out.split("collective sweep clean: its ")[1].split()[0])
    assert swept > 0 and result.parseoutcomes()["failed"] == swept + 1 and "fired 0 times in this run" in out


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_changed_learning_rate_is_convicted_as_optimizer(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "fsdp and not resume and not bf16", "--gpuregress-inject=lr_scale:factor=1.01")
    result.assert_outcomes(failed=1, passed=2)  # equivalence and oracle stay clean: step 0 precedes the update
    out = result.stdout.str()
    assert "triage verdict: optimizer." in out and "Evidence: equivalence clean" in out
    assert "divergence starts: step 0 matches" in out and "the first difference is at step 1" in out
    # step 6's gradients from the reference's own checkpoint are right, and the steps after it diverge again in a
    # fresh process: the update is what went wrong
    assert "late window reproduced: step 6's" in out and "from the reference's own state at step 6" in out
    assert "match the reference's" in out and "diverge again in a fresh process" in out
    result.stdout.fnmatch_lines(["*[[]optimizer[]] loss: first differing step 1 of 8*"])
    assert "] step0_grad" not in out  # step 0 ran before the first optimizer step


def test_a_fault_on_rank_1_only_is_a_collective_and_names_rank_1(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "equivalence", "--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-3,ranks=1")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    line = next((line for line in out.splitlines() if "[collective] equivalence of fsdp: " in line), "")
    assert "2 ranks differ from 1 rank" in line and line.endswith(" at step 0 beyond 5.7e-06, in rank 1"), out
    assert "in the shard of rank 0" not in out
