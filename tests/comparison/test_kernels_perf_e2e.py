"""Kernel inventory, host fallbacks and throughput, end to end: real ranks against the session's 8-step
fsdp reference (conftest.py), each change injected and seen reported with the op or figure named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import FSDP_ONLY, FSDP_STEPS

pytestmark = pytest.mark.slow

SDPA_CHANGE = ("aten::scaled_dot_product_attention: _scaled_dot_product_flash_attention_for_cpu -> "
               "_scaled_dot_product_attention_math")


def run(pytester: pytest.Pytester, refs: Path, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
                              f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY, "-W", "default", *extra)


def test_the_reference_carries_an_inventory_and_perf_figures(fsdp_reference: Path) -> None:
    stored = json.loads((fsdp_reference / "fsdp" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    inventory, perf = stored["results"]["kernels"], stored["results"]["perf"]
    assert inventory["aten::scaled_dot_product_attention"]["dispatch"] == [
        "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert inventory["aten::linear"]["calls"] > 0
    assert perf["median_step_s"] > 0 and perf["tokens_per_s"] > 0 and perf["peak_memory_bytes"] > 0
    assert perf["memory"] == "peak RSS growth of this run"
    assert perf["steady_steps"] == 3 and "bus_bandwidth_gbps" not in perf  # too short to be judged: not measured
    shipped = json.loads((Path(__file__).resolve().parents[2] / "reference_runs" / "fsdp" / "cpu-gloo-w2-fp32" /
                          "record.json").read_text())["results"]["perf"]
    assert shipped["steady_steps"] == 295 and shipped["bus_bandwidth_gbps"] > 0
    assert "host_ops" not in stored["results"]  # a CPU run has no host to fall back to


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_sdpa_forced_to_math_is_named_next_to_the_deviation_and_in_triage(pytester: pytest.Pytester,
                                                                         fsdp_reference: Path) -> None:
    result = run(pytester, fsdp_reference, "--gpuregress-inject=sdpa_backend:backend=math")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert SDPA_CHANGE in out
    report = out[out.index("gpuregress regression"):]
    assert "kernels changed since the reference" in report  # beside the numeric deviation, in the failure
    result.stdout.fnmatch_lines(["*triage verdict: kernel. Evidence: *kernels changed: * ops run other kernels than "
                                 "in the reference, first *"])


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_kernel_changes_and_slowdowns_alone_warn_and_fail_only_when_asked(pytester: pytest.Pytester,
                                                                        fsdp_reference: Path) -> None:
    # The tolerant lane: math SDPA keeps the numbers within the envelope, and sleeping changes none.
    changes = ("--gpuregress-lane=tolerant", "--gpuregress-inject=sdpa_backend:backend=math",
               "--gpuregress-inject=slow_step:seconds=0.2")
    warned = run(pytester, fsdp_reference, *changes)
    warned.assert_outcomes(passed=1)
    warned.stdout.fnmatch_lines(["*GpuRegressKernelWarning*kernels changed since the reference*",
                                 "*GpuRegressPerfWarning*tokens/s * worse (limit 1.5x)*"])  # a warning names no component
    assert SDPA_CHANGE in warned.stdout.str()
    # With both options, and an op made to run on the CPU (a GPU emulated by a device tag): three failures.
    failed = run(pytester, fsdp_reference, *changes, "--gpuregress-kernel-changes=fail", "--gpuregress-perf=fail",
                 "--gpuregress-inject=host_op:op=silu")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*[[]kernel[]] 1 op(s) ran on the CPU while 'fsdp' runs on cuda (emulated by a "
                                 "device tag): aten::silu (* calls, float32 [[]8, 64, 176[]])*"])
    failed.stdout.fnmatch_lines([
        "*[[]kernel[]] kernels changed since the reference (6 ops; --gpuregress-kernel-changes=fail):*",
        f"*{SDPA_CHANGE}*",
        "*[[]performance[]] tokens/s * vs * in the reference: *x worse (limit 1.5x); medians over * steady steps "
        "(--gpuregress-perf=fail)*"], consecutive=False)
