"""Kernel inventories, host fallbacks and perf ratios, unit by unit: the comparison side on synthetic
records, the rank side on a real profile in this process."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_gpuregress.comparison import perf
from pytest_gpuregress.comparison.judgement import JudgingPolicy
from pytest_gpuregress.comparison.observations import GpuRegressKernelWarning, GpuRegressPerfWarning, Observations
from pytest_gpuregress.evidence import kernels
from pytest_gpuregress.training import observe
from pytest_gpuregress.triage import Experiment, verdict
from pytest_gpuregress.triage.naming import described

from ..conftest import make_record

FLASH = {"dispatch": ["aten::_scaled_dot_product_flash_attention_for_cpu"], "kernels": [], "calls": 4}
MATH = {"dispatch": ["aten::_scaled_dot_product_attention_math"], "kernels": [], "calls": 4}
LINEAR = {"dispatch": ["aten::matmul", "aten::t"], "kernels": [], "calls": 30}
PERF = {"median_step_s": 0.1, "steady_steps": 290, "tokens_per_s": 10240.0, "peak_memory_bytes": 400 << 20,
        "memory": "peak RSS of this run", "bus_bandwidth_gbps": 1.0}


def with_results(**results: object):  # noqa: ANN201 - a RunRecord
    record = make_record()
    record.results = dict(results)
    return record


def test_a_changed_sdpa_backend_is_one_line_naming_op_and_kernels() -> None:
    ref = with_results(kernels={"aten::scaled_dot_product_attention": FLASH, "aten::linear": LINEAR})
    run = with_results(kernels={"aten::scaled_dot_product_attention": MATH, "aten::linear": LINEAR,
                                "aten::bmm": {"dispatch": [], "kernels": [], "calls": 8}})
    assert kernels.changes(ref, run) == [
        "aten::bmm: newly called, runs as its own kernel",
        "aten::scaled_dot_product_attention: _scaled_dot_product_flash_attention_for_cpu -> "
        "_scaled_dot_product_attention_math",
    ]
    op, _, how = kernels.changes(run, ref)[0].partition(": ")
    assert (op, how) == ("aten::bmm", "no longer called (was its own kernel)")
    assert kernels.changes(ref, ref) == []
    assert kernels.changes(make_record(), run) is None  # a reference from before inventories: nothing to compare


def test_gpu_kernel_names_count_and_call_counts_do_not() -> None:
    gemm = {"dispatch": ["aten::addmm"], "kernels": ["sm90_xmma_gemm_bf16bf16"], "calls": 10}
    other = {**gemm, "kernels": ["Cijk_Ailk_Bljk_BBS_BH"], "calls": 99}
    assert kernels.changes(with_results(kernels={"aten::linear": gemm}),
                           with_results(kernels={"aten::linear": {**gemm, "calls": 99}})) == []
    assert kernels.changes(with_results(kernels={"aten::linear": gemm}), with_results(kernels={"aten::linear": other})) \
        == ["aten::linear: sm90_xmma_gemm_bf16bf16 -> Cijk_Ailk_Bljk_BBS_BH"]


def test_report_lines_show_twelve_ops_and_count_the_rest() -> None:
    lines = kernels.report_lines([f"aten::op{i}: a -> b" for i in range(20)])
    assert lines[0].startswith("kernels changed") and lines[0].endswith("(20 ops):")
    assert len(lines) == 1 + kernels.SHOWN + 1 and "... and 8 more" in lines[-1]
    assert kernels.report_lines([]) == [] and kernels.report_lines(None) == []


def test_host_ops_of_a_gpu_run_are_one_kernel_finding_naming_each_op() -> None:
    run = with_results(host_ops={"accelerator": "cuda", "ops": {
        "aten::silu": {"calls": 4, "shape": [8, 64, 176], "dtype": "float32"}}})
    [finding] = map(described, kernels.host_op_problems(run))
    assert finding.startswith("[kernel] 1 op(s) ran on the CPU while 'fsdp' runs on cuda: "
                              "aten::silu (4 calls, float32 [8, 64, 176])")
    assert kernels.host_op_problems(with_results(host_ops={"accelerator": "cuda", "ops": {}})) == []
    assert kernels.host_op_problems(make_record()) == []


def test_perf_ratios_say_worse_by_and_pass_limits_only_when_past_them() -> None:
    slower = {**PERF, "median_step_s": 0.3, "tokens_per_s": 10240.0 / 3, "peak_memory_bytes": 560 << 20,
              "bus_bandwidth_gbps": 0.9}
    found = perf.ratios(with_results(perf=PERF), with_results(perf=slower))
    by_name = {r.name: r for r in found}
    assert by_name["step time"].worse_by == pytest.approx(3.0)
    assert by_name["tokens/s"].worse_by == pytest.approx(3.0) and by_name["tokens/s"].over
    assert by_name["peak memory"].worse_by == pytest.approx(1.4) and by_name["peak memory"].over
    assert not by_name["all-reduce bus bandwidth"].over  # 1.11x worse, limit 1.5x
    problems = perf.problems(found, with_results(perf=slower))
    assert len(problems) == 2  # tokens/s and memory: the step time says the same as tokens/s
    tokens, memory = problems
    assert tokens.startswith("tokens/s 3413 tokens/s vs 1.024e+04") and "3.00x worse (limit 1.5x)" in tokens
    assert tokens.endswith("; medians over 290 steady steps")
    assert memory.startswith("peak memory 560 MiB vs 400 MiB") and "1.40x worse (limit 1.3x)" in memory
    assert perf.problems(perf.ratios(with_results(perf=PERF), with_results(perf=PERF)), make_record()) == []
    assert perf.summary(found).split(", ")[:3] == ["step time 3.00x slower", "tokens/s 3.00x slower",
                                                   "peak memory 1.40x larger"]
    faster = perf.ratios(with_results(perf=slower), with_results(perf=PERF))
    assert perf.summary(faster).split(", ")[:3] == ["step time 3.00x faster", "tokens/s 3.00x faster",
                                                    "peak memory 1.40x smaller"]


def test_perf_limits_are_options_and_peak_rss_is_not_compared_with_device_memory() -> None:
    slower = {**PERF, "median_step_s": 0.13, "tokens_per_s": 10240.0 / 1.3}
    assert not any(r.over for r in perf.ratios(with_results(perf=PERF), with_results(perf=slower)))
    assert any(r.over for r in perf.ratios(with_results(perf=PERF), with_results(perf=slower), slowdown=1.2))
    on_gpu = {**PERF, "memory": "device (max allocated)", "peak_memory_bytes": 1}
    assert "peak memory" not in {r.name for r in perf.ratios(with_results(perf=PERF), with_results(perf=on_gpu))}
    assert perf.ratios(make_record(), with_results(perf=PERF)) is None


@pytest.mark.parametrize("mode", ["report", "fail"])
def test_observations_report_or_fail_kernel_changes_as_asked(mode: str) -> None:
    ref = with_results(kernels={"aten::scaled_dot_product_attention": FLASH}, perf=PERF)
    run = with_results(kernels={"aten::scaled_dot_product_attention": MATH}, perf=PERF)
    seen = Observations.of(ref, run, JudgingPolicy(kernel_changes=mode))
    if mode == "fail":
        assert described(seen.failures()[0]).startswith(
            "[kernel] kernels changed since the reference (1 ops; --gpuregress-kernel-changes=fail): (rule ")
        assert not seen.warnings()
    else:
        assert seen.failures() == []
        [(category, message)] = seen.warnings()
        assert category is GpuRegressKernelWarning and "flash_attention_for_cpu -> " in message
    assert [r.short() for r in seen.ratios] == [f"{r.name} unchanged" for r in seen.ratios] and len(seen.ratios) == 4
    assert seen.detail() == f"perf vs reference: {perf.summary(seen.ratios)}; kernels changed: 1"


def test_observations_warn_or_fail_on_a_slowdown_and_can_be_turned_off() -> None:
    ref, run = with_results(perf=PERF), with_results(perf={**PERF, "median_step_s": 0.4, "tokens_per_s": 2560.0})
    warned = Observations.of(ref, run, JudgingPolicy())
    assert warned.failures() == [] and warned.warnings()[0][0] is GpuRegressPerfWarning
    assert "(--gpuregress-perf=fail to fail on it)" in warned.warnings()[0][1]
    failed = Observations.of(ref, run, JudgingPolicy(perf="fail"))
    assert failed.failures()[0].message.endswith("(--gpuregress-perf=fail)")
    off = Observations.of(ref, run, JudgingPolicy(perf="off", kernel_changes="off"))
    assert off.failures() == [] and off.warnings() == [] and off.detail() == ""
    assert off.kernel_changes is None and off.evidence()[0].startswith("kernels: not compared (no inventory")


@pytest.mark.parametrize("other", [{"cpu_model": "Intel(R) Xeon(R) Platinum 8488C"}, {"cpu_capability": "AVX512"},
                                   {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 8}])
def test_perf_is_not_judged_against_a_reference_timed_on_other_hardware(other: dict[str, object]) -> None:
    """A 3x slowdown on another CPU or GPU model is printed as information with the reason, never warned or failed."""
    device = {"kind": "cpu", "name": "cpu", "count": None, "cpu_model": "AMD EPYC", "cpu_capability": "AVX2"}
    ref = with_results(perf=PERF)
    run = with_results(perf={**PERF, "median_step_s": 0.4, "tokens_per_s": 2560.0})
    ref.fingerprint = {**ref.fingerprint, "device": device}
    run.fingerprint = {**run.fingerprint, "device": {**device, **other}}
    for options in (JudgingPolicy(), JudgingPolicy(perf="fail")):
        seen = Observations.of(ref, run, options)
        assert seen.failures() == [] and seen.warnings() == [] and seen.perf_problems == []
        assert seen.perf_not_judged.startswith("not judged") and "other hardware (device." in seen.perf_not_judged
        assert f"bus bandwidth unchanged ({seen.perf_not_judged})" in seen.detail()
    run.fingerprint = {**run.fingerprint, "device": device}  # the same hardware: judged
    assert Observations.of(ref, run, JudgingPolicy(perf="fail")).failures()[0].message.startswith("tokens/s")
    # An AVX512 CPU forced down to AVX2 reads like the AVX2 machine that recorded: not judged either.
    run.fingerprint = {**run.fingerprint, "comm": {"env": {"ATEN_CPU_CAPABILITY": "avx2"}}}
    forced = Observations.of(ref, run, JudgingPolicy(perf="fail"))
    assert forced.failures() == [] and forced.perf_not_judged.endswith("(comm.env.ATEN_CPU_CAPABILITY: None -> avx2)")


def test_perf_on_the_same_gpus_is_judged_whatever_the_host_cpu() -> None:
    gpus = {"kind": "cuda", "name": "NVIDIA H200", "count": 8, "arch": "sm_90", "cpu_model": "Intel Xeon"}
    ref = with_results(perf=PERF)
    run = with_results(perf={**PERF, "median_step_s": 0.4, "tokens_per_s": 2560.0})
    ref.fingerprint = {**ref.fingerprint, "device": gpus}
    run.fingerprint = {**run.fingerprint, "device": {**gpus, "cpu_model": "AMD EPYC"}}
    assert Observations.of(ref, run, JudgingPolicy(perf="fail")).failures()[0].message.startswith("tokens/s")
    run.fingerprint = {**run.fingerprint, "device": {**gpus, "count": 4}}  # half the GPUs: not comparable
    assert Observations.of(ref, run, JudgingPolicy(perf="fail")).failures() == []


def test_kernel_changes_are_triage_evidence_and_decide_an_inconclusive_verdict() -> None:
    from pytest_gpuregress.comparison.compare import Comparison, Finding

    finding = Finding("step0_grad", "step0_grad differs", step=0, component="kernel")
    comparison = Comparison("exact", "", [finding], [], kernel_changes=["aten::sdpa: flash -> math"])
    clean = [Experiment("equivalence", "clean", "agree"), Experiment("oracle", "clean", "matches float64")]
    found = verdict(comparison, clean)
    assert (found.component, found.rule) == ("kernel", "kernels-changed")
    assert "kernels changed: 1 ops" in found.quoted and "first aten::sdpa: flash -> math" in found.quoted
    unchanged = dataclasses.replace(comparison, kernel_changes=[])
    assert verdict(unchanged, clean).component is None  # step 0 differs, nothing convicted, nothing changed: inconclusive


def test_the_profile_window_is_steady_or_the_end_of_a_short_run() -> None:
    assert observe.profile_window(300) == range(5, 7)
    assert observe.profile_window(3) == range(1, 3)
    assert observe.profile_window(1) == range(0, 1)


def test_merge_keeps_the_largest_peak_memory_and_every_ranks_host_ops() -> None:
    host = {"accelerator": "cuda", "ops": {"aten::silu": {"calls": 2, "shape": [4], "dtype": "float32"}}}
    zero = with_results(perf={**PERF, "peak_memory_bytes": 1}, host_ops=host)
    one = with_results(perf={**PERF, "peak_memory_bytes": 5}, host_ops=host)
    merged = observe.merge_ranks([zero, one])
    assert merged["perf"]["peak_memory_bytes"] == 5
    assert merged["host_ops"]["ops"]["aten::silu"]["calls"] == 4


# --- the rank side, in this process ---------------------------------------------------------------


def attention_step() -> None:
    import torch
    import torch.nn.functional as F

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    layer = torch.nn.Linear(8, 8)
    (F.scaled_dot_product_attention(q, q, q, is_causal=True).sum() + F.silu(layer(q)).sum()).backward()


def test_the_inventory_names_the_sdpa_backend_that_ran() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pytest_gpuregress.training.kernels import KernelWindow

    default, forced = KernelWindow("cpu"), KernelWindow("cpu")
    with default.capture():
        attention_step()
    with sdpa_kernel(SDPBackend.MATH), forced.capture():
        attention_step()
    sdpa = "aten::scaled_dot_product_attention"
    assert default.inventory[sdpa]["dispatch"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert forced.inventory[sdpa]["dispatch"] == ["aten::_scaled_dot_product_attention_math"]
    assert default.inventory["aten::linear"]["calls"] == 1
    assert default.results() == {"kernels": default.inventory}  # a CPU run: no host ops to watch


def test_the_host_watcher_sees_the_tagged_op_only_and_only_under_emulation() -> None:
    import torch.nn.functional as F

    from pytest_gpuregress.training.kernels import KernelWindow, host_fallback, set_emulated_accelerator

    set_emulated_accelerator("cuda (emulated)")
    try:
        window = KernelWindow("cpu")
        original = F.silu

        def silu(x, inplace=False):  # noqa: ANN001, ANN202 - F.silu's signature
            with host_fallback():
                return original(x)

        F.silu = silu
        try:
            with window.watch_host():
                attention_step()
        finally:
            F.silu = original
        assert list(window.host_ops) == ["aten::silu"] and window.host_ops["aten::silu"]["shape"] == [2, 4, 16, 8]
        assert window.results()["host_ops"]["accelerator"] == "cuda (emulated)"
    finally:
        set_emulated_accelerator(None)
    assert KernelWindow("cpu").accelerator is None


def test_short_kernel_names_keep_the_first_template_argument_only() -> None:
    from pytest_gpuregress.training.kernels import short_kernel

    assert short_kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)") \
        == "at::native::vectorized_elementwise_kernel<4>"
    # a generic wrapper: the configuration is the first argument, and a change of it must show
    assert short_kernel("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_32x6_tn_align8>"
                        "(cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_32x6_tn_align8::Params)") \
        == "cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_32x6_tn_align8>"
    assert short_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") \
        == "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def test_on_a_gpu_run_the_loops_float64_bookkeeping_on_the_host_is_not_a_fallback() -> None:
    import torch

    from pytest_gpuregress.training.kernels import KernelWindow

    window = KernelWindow("cpu")
    window.accelerator = "cuda"  # as on a GPU run: every CPU tensor is the host's
    with window.watch_host():
        stats = torch.ones(113, dtype=torch.float64)  # the loss and 112 squared norms, after .cpu()
        (stats[0] / 2, stats[1:].sqrt())
        torch.ones(8, 16).mul(2.0)  # float32 work on the host: a kernel that fell back
    assert list(window.host_ops) == ["aten::mul"]


def test_a_run_stopped_before_its_window_keeps_no_inventory_and_no_perf() -> None:
    from types import SimpleNamespace

    ctx = SimpleNamespace(device_kind="cpu", device="cpu", profile=True, progress=lambda label: None)
    observer = observe.StepObserver(ctx, steps=300, tokens_per_step=1024)
    for step in range(3):  # fail-fast stopped after step 2: warm-up steps only
        with observer.step(step):
            pass
    observer.finish(world_size=1)
    assert observer.results() == {}
    assert observer.timings()["median_step_s"] == 0.0


def test_perf_problems_need_enough_steady_steps_on_both_sides() -> None:
    slower = {**PERF, "median_step_s": 0.3, "tokens_per_s": 1000.0}
    found = perf.ratios(with_results(perf=PERF), with_results(perf=slower))
    assert perf.problems(found, with_results(perf=slower), with_results(perf=PERF))
    short = {**slower, "steady_steps": perf.MIN_STEADY_STEPS - 1}
    assert perf.problems(found, with_results(perf=short), with_results(perf=PERF)) == []


def test_merge_unites_every_ranks_kernels() -> None:
    zero = with_results(kernels={"aten::scaled_dot_product_attention": FLASH})
    one = with_results(kernels={"aten::scaled_dot_product_attention": MATH, "aten::linear": LINEAR})
    merged = observe.merge_ranks([zero, one])["kernels"]
    assert merged["aten::scaled_dot_product_attention"]["dispatch"] == sorted(FLASH["dispatch"] + MATH["dispatch"])
    assert "aten::linear" in merged


def test_cpu_peak_memory_is_the_growth_of_this_run() -> None:
    import numpy as np

    memory = observe.PeakMemory("cpu", "cpu")
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB touched
    grown = memory.peak()
    del block
    assert grown >= 60 << 20 and memory.kind == "peak RSS growth of this run"


def test_peak_memory_growth_below_the_floor_is_never_a_regression() -> None:
    # The CPU's peak-RSS growth of a tiny model: 464 KiB -> 1.7 MiB is 3.7x, and noise.
    small = perf.ratios(with_results(perf={**PERF, "peak_memory_bytes": 464 << 10}),
                        with_results(perf={**PERF, "peak_memory_bytes": 1741 << 10}))
    memory = next(r for r in small if r.name == "peak memory")
    assert memory.worse_by > 3 and not memory.over
    large = perf.ratios(with_results(perf=PERF), with_results(perf={**PERF, "peak_memory_bytes": 600 << 20}))
    assert next(r for r in large if r.name == "peak memory").over  # 400 -> 600 MiB: 1.5x and 200 MiB more


def test_an_injected_faults_own_ops_stay_out_of_the_inventory() -> None:
    import torch
    from torch.profiler import profile

    from pytest_gpuregress.training.kernels import fault_region, inventory_from_events

    x = torch.randn(8, 8)
    with profile() as prof:
        y = x @ x
        with fault_region():  # what a collective fault's nudge does: a comparison and a cast
            _ = (y[0, 0].to(torch.float64) != 0) & (y.abs().sum() > 0)
    inventory = inventory_from_events(prof.events())
    assert "aten::matmul" in inventory
    assert not {"aten::ne", "aten::abs", "aten::gt"} & set(inventory), sorted(inventory)


def test_the_host_op_fault_keeps_an_in_place_silu_in_place() -> None:
    import types

    import torch
    import torch.nn.functional as F

    from pytest_gpuregress import faults

    ctx = types.SimpleNamespace(cleanup_hooks=[], rank=0, device_kind="cpu")
    faults.install(["host_op"], ctx)
    try:
        x = torch.tensor([-1.0, 0.0, 2.0])
        out = F.silu(x, inplace=True)
        assert out is x and torch.allclose(x, torch.nn.functional.silu(torch.tensor([-1.0, 0.0, 2.0])))
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
