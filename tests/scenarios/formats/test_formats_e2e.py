"""The formats scenario end to end: ``pytest --gpuregress -k formats`` on two spawned gloo ranks.

The comparisons run against a copy of the CPU reference this repository ships
(reference_runs/formats), so they also prove that it is current for this stack; after a change to
the scenario, re-record it (docs/formats.md). Faults go in through ``--gpuregress-inject``, so their
installers run on the ranks. tests/scenarios/formats/test_formats_scenario.py covers every fault in-process; here the
point is the whole path, the messages and the warn mode.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pytest_gpuregress.resources import shipped_dir

from ...conftest import kept_run_passes, reproduced

pytestmark = [pytest.mark.slow, pytest.mark.cpu_sensitive]
FLIP = "--gpuregress-inject=format:mode=flip_overflow"


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    refs = tmp_path / "refs"
    shutil.copytree(shipped_dir("reference_runs") / "formats", refs / "formats")
    return refs


def run(pytester: pytest.Pytester, refs: Path, selection: str, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}",
                              "-k", selection, "-rf", *extra)


def test_a_cast_switched_from_saturating_to_nan_fails_by_name_and_nothing_else_does(pytester: pytest.Pytester,
                                                                                     recorded: Path) -> None:
    artifacts = pytester.path / "artifacts"
    result = run(pytester, recorded, "formats", FLIP, "--gpuregress-keep-runs", f"--gpuregress-artifacts={artifacts}")
    result.assert_outcomes(passed=28, failed=1)  # 24 conformance and checkpoint cases, 5 stack I/O paths
    result.stdout.fnmatch_lines([
        "*lane: *",
        "[[]format[]] overflow to e4m3fn now gives NaN; the reference saturated to 448",
        "[[]format[]] +inf to e4m3fn now gives NaN; the reference saturated to 448",
        "*if the new numbers are right, record them as the reference: pytest --gpuregress --gpuregress-record "
        "'gpuregress::formats[*]'*",
        "FAILED gpuregress::formats-behaviour-e4m3fn*",
    ])
    out = result.stdout.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out
    assert "gpuregress formats: torch._scaled_mm " in out and "not applicable on the cpu" in out
    # The printed command fails the kept run again; a passing case's kept run passes through the same command.
    assert reproduced(out) == [1]
    assert kept_run_passes(artifacts, "formats-decode-e4m3fn", "cpu-gloo-w2-fp32") == 0


def test_warn_mode_passes_and_still_lists_the_change(pytester: pytest.Pytester, recorded: Path) -> None:
    result = run(pytester, recorded, "formats and behaviour", FLIP, "--gpuregress-format-changes=warn")
    result.assert_outcomes(passed=6, warnings=4)
    result.stdout.fnmatch_lines([
        "*FormatBehaviourChanged: overflow to e4m3fn now gives NaN; the reference saturated to 448",
        "format behaviours that changed since the reference (--gpuregress-format-changes=warn, not failed):",
        "  overflow to e4m3fn now gives NaN; the reference saturated to 448",
    ])


def test_a_misread_inside_dcp_fails_its_io_case_by_name_on_two_spawned_ranks(pytester: pytest.Pytester,
                                                                            recorded: Path) -> None:
    """The fault sits in torch.distributed.checkpoint.load on both ranks; the sharded DCP case catches it and the
    fault counts as fired; the other stack I/O paths never call that loader, so they are skipped saying so."""
    result = run(pytester, recorded, "formats and io-", "--gpuregress-inject=format:mode=loader_fn_as_fnuz,path=dcp")
    result.assert_outcomes(skipped=4, failed=1)
    result.stdout.fnmatch_lines([
        "*[[]checkpoint[]] dcp (torch *): per_tensor_e4m3fn: dcp.load (rank 0 of 2): * tensors; first *: written "
        "as torch.float8_e4m3fn (F8_E4M3), read back as torch.float8_e4m3fnuz: the loader reads e4m3fn bytes as "
        "e4m3fnuz, every value 0.5x (factor 2)*",
        "FAILED gpuregress::formats-io-dcp*",
    ])
    assert "fired 0 times" not in result.stdout.str()
    assert reproduced(result.stdout.str()) == [1]  # the kept run fails again through the printed command
