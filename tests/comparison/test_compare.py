"""The comparison lanes, the suspected component, and the failure report."""

from __future__ import annotations

import numpy as np

from pytest_gpuregress.comparison.compare import ulp_distance, ulps32
from pytest_gpuregress.comparison.report import format_comparison

from ..conftest import compare_named, make_record


def _report(cmp) -> str:  # type: ignore[no-untyped-def]
    return format_comparison(cmp, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="REF",
                             record_hint="HINT")


def test_identical_runs_pass_in_the_exact_lane() -> None:
    cmp = compare_named(make_record(), make_record())
    assert cmp.lane == "exact" and cmp.passed


def test_one_ulp_in_the_loss_fails_the_exact_lane_at_its_step() -> None:
    run = make_record()
    loss = run.series["loss"]
    loss[3] = float(np.nextafter(np.float32(loss[3]), np.float32(10)))
    cmp = compare_named(make_record(), run)
    finding = next(f for f in cmp.findings if f.metric == "loss")
    assert finding.step == 3 and "first differing step 3" in finding.message and "ulp32" in finding.message
    assert "HINT" in _report(cmp)


def test_a_loss_below_one_float32_ulp_away_never_reads_as_zero_ulps() -> None:
    # Losses are float64: a difference float32 cannot see used to print "(0 ulp32)".
    run = make_record()
    run.series["loss"][2] = float(np.nextafter(run.series["loss"][2], 10.0))
    finding = next(f for f in compare_named(make_record(), run).findings if f.metric == "loss")
    assert "(1 ulp64, within one float32 ulp)" in finding.message and "0 ulp32" not in finding.message
    assert ulp_distance(1.0, 1.0) == "0 ulp32" and ulp_distance(2.0, 1.0) == "8388608 ulp32"
    assert ulp_distance(-1.0, float(np.nextafter(-1.0, 0.0))) == "1 ulp64, within one float32 ulp"


def test_changed_stack_selects_the_tolerant_lane_and_reports_the_change() -> None:
    run = make_record()
    run.fingerprint = {**run.fingerprint, "versions": {"torch": "2.14.1", "python": "3.11.7"}}
    run.series["loss"] = [x * (1 + 1e-8) for x in run.series["loss"]]
    cmp = compare_named(make_record(), run)
    assert cmp.lane == "tolerant" and cmp.passed
    assert ("versions.torch", "2.13.0", "2.14.1") in cmp.stack_changes


def test_the_lane_reason_names_every_library_change_first_however_many_device_fields_changed() -> None:
    """On another CPU the device fields change too; the summary line must still name each library change."""
    old_versions = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.15.0", "numpy": "2.4.6"}
    new_versions = {"torch": "2.14.1", "transformers": "5.0.0", "peft": "0.20.0", "accelerate": "1.14.0", "numpy": "2.3.0"}
    old_device = {"kind": "cpu", "name": "cpu", "arch": "x86_64", "cpu_model": "AMD EPYC", "cpu_capability": "AVX2",
                  "count": None, "blas_library": None}
    new_device = {"kind": "cpu", "name": "cpu", "arch": "x86_64-v4", "cpu_model": "Intel(R) Xeon(R) Platinum 8488C",
                  "cpu_capability": "AVX512", "count": 2, "blas_library": "openblas"}
    reference, run = make_record(), make_record()
    reference.fingerprint = {"versions": old_versions, "device": old_device}
    run.fingerprint = {"versions": new_versions, "device": new_device}
    cmp = compare_named(reference, run)
    reason = cmp.lane_reason
    assert cmp.lane == "tolerant"
    named = [f"{name} {old_versions[name]} -> {new}" for name, new in new_versions.items()]
    assert all(text in reason for text in named), reason
    assert max(reason.index(text) for text in named) < reason.index("device.arch")  # software first
    assert "device.blas_library: None -> openblas" in reason  # the BLAS is software: never cut
    assert "and 1 more (" in reason and "stack_changes)" in reason, reason  # 4 hardware fields, 3 shown
    report = _report(cmp)  # the failure report lists every change
    assert all(f"  {text}" in report for text in named) and "device.cpu_capability: AVX2 -> AVX512" in report


def test_a_cuda_upgrade_keeps_its_runtime_driver_dnn_and_nccl_on_the_lane_line() -> None:
    """torch + CUDA 12.4 -> 12.8 + cuDNN + driver + NCCL: the changes a GPU upgrade is about are never cut."""
    old_device = {"kind": "cuda", "name": "NVIDIA H100", "count": 8, "arch": "sm_90", "cuda": "12.4", "driver": "550.54",
                  "dnn": "cudnn 9.1.0", "blas_library": "cublaslt", "cpu_model": "Intel Xeon", "cpu_capability": "AVX512"}
    new_device = {**old_device, "cuda": "12.8", "driver": "570.86", "dnn": "cudnn 9.7.0", "blas_library": "cublas",
                  "name": "NVIDIA H100 80GB HBM3", "count": 4, "cpu_model": "AMD EPYC", "cpu_capability": "AVX2"}
    reference, run = make_record(), make_record()
    reference.fingerprint = {"versions": {"torch": "2.6.0"}, "device": old_device, "comm": {"nccl_version": "2.21.5"}}
    run.fingerprint = {"versions": {"torch": "2.8.0"}, "device": new_device, "comm": {"nccl_version": "2.26.2"}}
    reason = compare_named(reference, run).lane_reason
    for text in ("torch 2.6.0 -> 2.8.0", "device.cuda: 12.4 -> 12.8", "device.driver: 550.54 -> 570.86",
                 "device.dnn: cudnn 9.1.0 -> cudnn 9.7.0", "device.blas_library: cublaslt -> cublas",
                 "comm.nccl_version: 2.21.5 -> 2.26.2"):
        assert text in reason, (text, reason)
    assert "and 1 more (all in the failure report" in reason, reason  # 4 hardware fields, 3 shown


def test_python_patch_level_does_not_leave_the_exact_lane() -> None:
    run = make_record()
    run.fingerprint = {**run.fingerprint, "versions": {"torch": "2.13.0", "python": "3.11.9"}}
    assert compare_named(make_record(), run).lane == "exact"


def test_sparse_step0_gradient_error_points_at_a_collective() -> None:
    run = make_record()
    grad = run.arrays["step0_grad/a.weight"].copy()
    grad[5, 3] *= 1.001
    run.arrays["step0_grad/a.weight"] = grad
    cmp = compare_named(make_record(), run, lane="tolerant")
    finding = cmp.findings[0]
    assert finding.metric == "step0_grad" and finding.component == "collective"
    assert finding.tensor == "a.weight" and "(5, 3)" in finding.message and "[16, 8] = 128 elements" in finding.message
    report = _report(cmp)
    assert "[collective]" in report and "worst entries" in report and "(5, 3)" in report


def test_dense_step0_gradient_error_points_at_a_kernel() -> None:
    run = make_record()
    run.arrays["step0_grad/b.weight"] = run.arrays["step0_grad/b.weight"] * np.float32(1.001)
    cmp = compare_named(make_record(), run, lane="tolerant")
    assert cmp.findings[0].component == "kernel"


def test_late_divergence_with_clean_step0_points_at_optimizer_or_collective() -> None:
    run = make_record()
    run.series["loss"] = run.series["loss"][:2] + [x * 1.01 for x in run.series["loss"][2:]]
    cmp = compare_named(make_record(), run, lane="tolerant")
    loss = next(f for f in cmp.findings if f.metric == "loss")
    assert loss.step == 2 and loss.component == "optimizer or collective"


def _late_gradients(loss_from: int | None = 4) -> object:
    """A reduce-scatter that goes wrong from step 3: step 3's loss (the same weights) is bitwise equal, its
    per-parameter gradient norms are not, and the loss follows from ``loss_from`` (None: never)."""
    run = make_record()
    run.arrays["param_grad_norm"] = run.arrays["param_grad_norm"].copy()
    run.arrays["param_grad_norm"][3:, 1] *= 1.001
    if loss_from is not None:
        run.series["loss"] = run.series["loss"][:loss_from] + [x * 1.001 for x in run.series["loss"][loss_from:]]
    return run


def test_late_gradients_that_move_before_their_steps_loss_point_at_a_collective_or_kernel_not_the_update() -> None:
    cmp = compare_named(make_record(), _late_gradients(), lane="exact")
    assert {f.metric: (f.step, f.component) for f in cmp.findings if f.metric in ("loss", "param_grad_norm")} == {
        "param_grad_norm": (3, "collective or kernel"), "loss": (4, "collective or kernel")}


def test_the_order_of_first_findings_proves_nothing_in_the_tolerant_lane_or_without_a_loss_finding() -> None:
    # Tolerant: each metric has its own limit, and one tensor's norm can cross its limit before the averaged loss.
    tolerant = compare_named(make_record(), _late_gradients(), lane="tolerant")
    assert {f.component for f in tolerant.findings} == {"optimizer or collective"}
    never = compare_named(make_record(), _late_gradients(loss_from=None), lane="exact")
    assert {f.component for f in never.findings} == {"optimizer or collective"}


def test_triage_calls_a_late_divergence_the_optimizer_only_where_it_recurs_and_the_loss_moves_first() -> None:
    from pytest_gpuregress.triage import Experiment, verdict

    clean = [Experiment("equivalence", "clean", "agree"), Experiment("oracle", "clean", "agree")]
    update = make_record()
    update.series["loss"] = update.series["loss"][:2] + [x * 1.01 for x in update.series["loss"][2:]]
    found = verdict(compare_named(make_record(), update, lane="exact"), clean)
    component, line = found.component, found.line
    assert component is None and "the first difference is at step 2" in line  # elimination convicts nothing
    reproduced = Experiment("late window", "reproduced", "again in a fresh process", component="optimizer")
    found = verdict(compare_named(make_record(), update, lane="exact"), [*clean, reproduced])
    component, line = found.component, found.line
    assert component == "optimizer" and "the first difference is at step 2" in line
    found = verdict(compare_named(make_record(), _late_gradients(), lane="exact"), clean)
    component, line = found.component, found.line
    assert component is None and "the gradients move before the loss" in line and "the update is not the cause" in line


def test_nan_is_a_difference_in_both_lanes() -> None:
    run = make_record()
    run.series["loss"][1] = float("nan")
    for lane in ("exact", "tolerant"):
        cmp = compare_named(make_record(), run, lane=lane)
        loss = next(f for f in cmp.findings if f.metric == "loss")
        assert loss.step == 1, lane
        assert "got nan" in loss.message, loss.message


def test_final_weights_compared_by_digest() -> None:
    run = make_record()
    run.digests = {**run.digests, "b.weight": {**run.digests["b.weight"], "sha256": "cc"}}
    cmp = compare_named(make_record(), run)
    assert [f.metric for f in cmp.findings] == ["final_weights"] and "b.weight" in cmp.findings[0].message


def test_ulps32_counts_representable_steps() -> None:
    one = np.float32(1.0)
    assert int(ulps32(np.asarray(one), np.asarray(np.nextafter(one, np.float32(2))))) == 1
    assert int(ulps32(np.asarray(np.float32(-0.0)), np.asarray(np.float32(0.0)))) == 0
