"""The formats scenario in this process: the rank code on the CPU, each fault of docs/faults.md
section 2 injected through its real installer, judged by the scenario's own verdicts and
reference comparisons. (tests/scenarios/formats/test_formats_e2e.py drives the same through ``pytest --gpuregress``
on two spawned ranks.)"""

from __future__ import annotations

import copy
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_gpuregress import fault_points, faults
from pytest_gpuregress.errors import BadFaultSpec
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import RankContext, Setup
from pytest_gpuregress.scenarios.formats import SCENARIO, device, judge, oracle, rank, scaled_mm
from pytest_gpuregress.scenarios.formats.catalog import FORMATS
from pytest_gpuregress.triage.naming import component_of, described

pytestmark = pytest.mark.cpu_sensitive  # .ci/run runs these again on a lower CPU kernel path

CPU = Setup("cpu", "gloo", 2, options={"gpuregress_format_changes": "fail"})
WARN = Setup("cpu", "gloo", 2, options={"gpuregress_format_changes": "warn"})


def run_rank(*specs: str, setup: Setup = CPU) -> RunRecord:
    """One rank's record, with ``specs`` installed the way the worker installs them."""
    ctx = RankContext(0, 2, 0, "cpu", "gloo", SCENARIO.default_config(setup), Path(tempfile.mkdtemp()))
    installed = faults.install(list(specs), ctx)
    try:
        record = rank.run(ctx)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    assert installed == list(specs)
    assert list(ctx.run_dir.iterdir()) == []  # the checkpoints' temporary folder is gone
    return record


def judged(reference: RunRecord, record: RunRecord, setup: Setup = CPU, lane: str = "auto") -> dict[str, list[str]]:
    """Case id -> its failure messages, as the session would report them (closed form, then reference)."""
    out = {}
    for case in SCENARIO.cases(setup):
        problems = [described(p) for p in SCENARIO.own_findings(case, record, setup)]
        if SCENARIO.reference_name(case):
            problems += [f.message for f in SCENARIO.compare(reference, record, case, lane).findings]
        if problems:
            out[case.id] = problems
    return out


@pytest.fixture(scope="module")
def clean() -> RunRecord:
    return SCENARIO.merge([run_rank()])


_faulted: dict[str, RunRecord] = {}


def faulted(spec: str) -> RunRecord:
    if spec not in _faulted:
        _faulted[spec] = SCENARIO.merge([run_rank(spec)])
    return _faulted[spec]


def test_a_clean_run_passes_every_case_and_removes_its_files(clean: RunRecord) -> None:
    assert judged(clean, clean) == {}
    assert {c.id for c in SCENARIO.cases(CPU)} >= {"decode-e2m1fn", "encode-e8m0fnu", "behaviour-e4m3fn",
                                                    "quantized-mx_fp4_e2m1fn", "inspect"}
    assert "scaled_mm" not in {c.id for c in SCENARIO.cases(CPU)}  # a GPU-only case
    assert clean.results["inspect"]["per_tensor_e4m3fn"] == {"findings": [], "notes": []}
    assert clean.arrays["decode/e2m1fn"].size == 512  # all 256 bytes of float4_e2m1fn_x2, unpacked
    assert "run" not in clean.config and "format_changes" not in clean.config  # selection never makes it foreign


@pytest.mark.parametrize(("spec", "expected"), [
    ("format:mode=fn_as_fnuz", {
        "decode-e4m3fn": "e4m3fn bytes are read as e4m3fnuz, every value 0.5x (factor 2)",
        "quantized-per_tensor_e4m3fn": "the device reads these F8_E4M3 bytes as e4m3fnuz, not e4m3fn: every value 0.5x",
        "quantized-mx_fp8_e4m3fn": "sum|w| ratio 0.5"}),
    ("format:mode=keep_0x80", {
        "quantized-per_tensor_e4m3fn_to_fnuz": "the 0x80 rewrite was skipped",
        "inspect": "are 0x80 in e4m3fnuz data (tagged F8_E4M3FNUZ): 0x80 is NaN in e4m3fnuz and negative zero in e4m3fn"}),
    ("format:mode=fnuz_max_448", {
        "quantized-per_tensor_e4m3fnuz": "the device's is amax/448, the oracle's amax/240",
        "inspect": "e4m3fn's maximum 448 was used where e4m3fnuz's maximum is 240, so values come out 1.867x too large"}),
    ("format:mode=flip_overflow", {
        "behaviour-e4m3fn": "overflow to e4m3fn now gives NaN; the reference saturated to 448"}),
    ("format:mode=flip_overflow,format=e5m2", {
        "behaviour-e5m2": "overflow to e5m2 now saturates to 57344; the reference gave inf"}),
    ("format:mode=mx_scale_off_by_one", {
        "quantized-mx_fp8_e4m3fn": "blocks off by +1 exponent(s)",
        "quantized-mx_fp4_e2m1fn": "blocks off by +1 exponent(s)",
        "inspect": "their e8m0 scale is 1 exponent(s) too large"}),
])
def test_each_injected_format_fault_is_caught_and_named(clean: RunRecord, spec: str, expected: dict[str, str]) -> None:
    failures = judged(clean, faulted(spec))
    assert set(failures) == set(expected), failures
    for case_id, text in expected.items():
        assert any(text in message for message in failures[case_id]), failures[case_id]


def test_faults_are_undone_after_the_run() -> None:
    originals = {name: getattr(device, name) for name in ("decode", "cast", "format_max", "fn_to_fnuz",
                                                          "mx_scale_exponent")}
    faulted("format:mode=fn_as_fnuz")
    assert {name: getattr(device, name) for name in originals} == originals
    assert fault_points.intercepted() == []  # the fault acted through its point, and let go of it


def test_format_fault_specs_are_checked() -> None:
    with pytest.raises(BadFaultSpec, match="mode='fn_as_fn' is not allowed; mode takes one of fn_as_fnuz|keep_0x80"):
        faults.parse("format:mode=fn_as_fn")
    from pytest_gpuregress.faults.formats import LOADER_MODES, PATCHES
    from pytest_gpuregress.faults.loaders import MODES

    # Every mode intercepts a fault point of the scenario's device functions, or (loader_*) wraps the stack's loaders.
    assert set(PATCHES) | set(LOADER_MODES) == set(faults.KINDS["format"].params["mode"].choices)
    assert set(LOADER_MODES) == set(MODES)
    ctx = RankContext(0, 1, 0, "cpu", "gloo", {}, Path("."))
    with pytest.raises(BadFaultSpec, match="fault kind 'format' needs mode="):
        faults.install(["format:by=2"], ctx)


def test_warn_mode_passes_a_behaviour_change_and_still_shows_it(clean: RunRecord) -> None:
    record = faulted("format:mode=flip_overflow")
    record.results["session"] = {**record.results["session"], "format_changes": "warn"}
    case = next(c for c in SCENARIO.cases(WARN) if c.id == "behaviour-e4m3fn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert SCENARIO.compare(clean, record, case, "auto").passed
    assert any(isinstance(w.message, judge.FormatBehaviourChanged) and "overflow to e4m3fn now gives NaN" in str(w.message)
               for w in caught)
    lines = SCENARIO.summary({"default": record}, WARN)
    start = lines.index("format behaviours that changed since the reference (--gpuregress-format-changes=warn, not failed):")
    assert any(line.startswith("  overflow to e4m3fn now gives NaN; ") and line.endswith(" saturated to 448")
               for line in lines[start:])
    record.results.pop("warned")


def test_a_path_only_rank_0_checks_is_no_disagreement_between_the_devices() -> None:
    # transformers' save_pretrained writes on rank 0 only, so rank 1 skips formats-io-transformers: that is no
    # measurement, and must not read as "the devices of this machine disagree".
    def io(**path: object) -> RunRecord:
        return RunRecord(scenario="formats", config={}, platform_key="cpu-gloo-w2-fp32", world_size=2,
                         results={"io": {"transformers": {"problems": [], "known_issues": [], "checked": 0, **path}}})

    rank0 = io(checked=12)
    skipped = io(skipped="under torch.distributed, save_pretrained writes on rank 0 only: rank 0 checks this path")
    assert judge.rank_differences(rank0, skipped) == []
    other = io(checked=12, problems=["fine_grained_e4m3fn: from_pretrained: 1 of 12 tensors; first w: 3 bytes differ"])
    assert judge.rank_differences(rank0, other) == ["io-transformers"]


def test_ranks_that_measure_differently_are_named(clean: RunRecord) -> None:
    merged = SCENARIO.merge([copy.deepcopy(clean), faulted("format:mode=mx_scale_off_by_one")])
    case = next(c for c in SCENARIO.cases(CPU) if c.id == "quantized-mx_fp4_e2m1fn")
    assert list(merged.results["rank_disagreements"]["quantized-mx_fp4_e2m1fn"]) == ["1"]
    theirs = merged.results["rank_disagreements"]["quantized-mx_fp4_e2m1fn"]["1"][0]
    assert theirs.startswith("mx_fp4_e2m1fn: e8m0 block scales")  # rank 1's own first finding
    (finding,) = SCENARIO.own_findings(case, merged, CPU)
    assert not isinstance(finding, str) and finding.check == "format"
    problem = described(finding)
    assert problem.startswith("[format] quantized-mx_fp4_e2m1fn: rank 1 ") and "otherwise than rank 0: " in problem
    assert "the devices of this machine disagree; " in problem and f"its own findings: {theirs}" in problem


def _linear_times(factor: float) -> Callable[[], None]:
    import torch.nn.functional as F

    original = F.linear
    F.linear = lambda *a, **k: original(*a, **k) * factor
    return lambda: setattr(F, "linear", original)


def test_logits_tolerance_sits_between_kernel_drift_and_a_fault(clean: RunRecord) -> None:
    undo = _linear_times(1 + 1e-7)  # legitimate kernel drift (docs/faults.md section 4)
    try:
        drifted = SCENARIO.merge([run_rank()])
    finally:
        undo()
    assert judged(clean, drifted, lane="tolerant") == {}
    exact = judged(clean, drifted, lane="exact")["quantized-mx_fp8_e4m3fn"]
    assert any("logits on the fixed batch differ" in message and "(bitwise)" in message for message in exact)
    [bitwise] = [f for f in judge.quantized_findings("mx_fp8_e4m3fn", clean, drifted, "exact") if f.metric == "logits"]
    assert "(bitwise)" in bitwise.message and bitwise.expected != bitwise.got
    mx = judge.quantized_findings("mx_fp8_e4m3fn", clean, faulted("format:mode=mx_scale_off_by_one"), "tolerant")
    [logits] = [f for f in mx if f.metric == "logits"]
    worst = re.search(r"logits on the fixed batch differ \(max \|diff\|/max\|ref\| (\S+) > ", logits.message)
    assert worst is not None and float(worst.group(1)) > judge.LOGITS_TOLERANCE, logits.message


def test_a_reference_that_fails_its_own_checks_vouches_for_nothing(clean: RunRecord) -> None:
    case = next(c for c in SCENARIO.cases(CPU) if c.id == "quantized-per_tensor_e4m3fnuz")
    bad_reference = faulted("format:mode=fnuz_max_448")
    findings = SCENARIO.compare(bad_reference, clean, case, "auto").findings
    assert any(f.metric == "reference" and f.message.startswith("the reference itself fails: ")
               and "per_tensor_e4m3fnuz" in f.message for f in findings)


def test_summary_and_header_on_the_cpu(clean: RunRecord) -> None:
    text = "\n".join(SCENARIO.summary({"default": clean}, CPU))
    assert "e4m3fn    overflow saturates to 448" in text and "e4m3fnuz  overflow gives NaN" in text
    assert "torch._scaled_mm (fp8 matrix multiply)" in text and "not applicable on the cpu" in text
    assert "has no float4_e2m1fn_x2 cast" in text
    [header] = SCENARIO.header(CPU)
    assert header.startswith("gpuregress formats: torch._scaled_mm ") and "not applicable on the cpu; " in header
    assert header.endswith("fp8 matrix multiply (sm_89+, gfx942+)")


REFUSED = "itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor inputFloat8_e4m3fnuz"
CRASHED = "CUDA error: an illegal memory access was encountered"


def scaled_mm_findings(result: dict[str, object]) -> list[str]:
    return [described(p) for p in judge.scaled_mm_problems(RunRecord("formats", {}, "", 1, results={"scaled_mm": result}))]


def test_the_gpu_scaled_mm_check_itself_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario reports it not applicable on the CPU, but torch 2.13 has a CPU _scaled_mm, so its
    arithmetic and its bound are tested here. Which formats the CPU kernel takes depends on the CPU:
    with AVX512, oneDNN refuses e4m3fnuz. Either way the check answers, and never raises."""
    assert scaled_mm.run("cpu") == {"applicable": False, "reason": scaled_mm.fp8_matmul_format("cpu")[1]}
    result = {**scaled_mm.check("cpu", FORMATS["e4m3fn"]), "arch": "cpu"}  # every CPU path takes e4m3fn
    assert 0 < result["worst_ratio"] <= 1e-3
    assert scaled_mm_findings(result) == []
    fnuz = {**scaled_mm.check("cpu", FORMATS["e4m3fnuz"]), "arch": "cpu"}
    if "refused" in fnuz:
        (finding,) = judge.scaled_mm_problems(RunRecord("formats", {}, "", 1, results={"scaled_mm": fnuz}))
        assert not isinstance(finding, str) and finding.check == "scaled-mm" and component_of(finding) == "kernel"
        assert finding.message == judge.refusal(fnuz) and "does not accept e4m3fnuz on cpu: " in finding.message
    else:
        assert 0 < fnuz["worst_ratio"] <= 1e-3 and scaled_mm_findings(fnuz) == []
    real = torch._scaled_mm
    # The bug class: one operand's fp8 flavour misread, so the product is off by a factor 2.
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: real(*a, **k) * 2)
    broken = {**scaled_mm.check("cpu", FORMATS["e4m3fn"]), "arch": "cpu"}
    (problem,) = scaled_mm_findings(broken)
    assert "x the derived error bound" in problem and broken["worst_ratio"] > 10


def test_a_scaled_mm_that_refuses_the_devices_fp8_format_is_a_finding_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an MI300 (gfx942: e4m3fnuz), a stack whose _scaled_mm refuses fnuz, as oneDNN does on AVX512 CPUs
    and cuBLASLt does on NVIDIA, gets a finding that names the format and the device, and the summary says it."""
    from pytest_gpuregress.scenarios.formats import summary

    def refuses_fnuz(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(REFUSED)

    monkeypatch.setattr(scaled_mm, "fp8_matmul_format", lambda dev: (FORMATS["e4m3fnuz"], "gfx942"))
    monkeypatch.setattr(torch, "_scaled_mm", refuses_fnuz)
    result = scaled_mm.run("cpu")  # the rank's own entry, as on the GPU
    assert result["refused"] == f"RuntimeError: {REFUSED}"
    (refused,) = judge.scaled_mm_problems(RunRecord("formats", {}, "", 1, results={"scaled_mm": result}))
    assert not isinstance(refused, str) and refused.check == "scaled-mm" and component_of(refused) == "kernel"
    (finding,) = scaled_mm_findings(result)
    assert finding.startswith("[kernel] this stack's torch._scaled_mm ") and "e4m3fnuz on gfx942: " in finding
    assert f"does not accept e4m3fnuz on gfx942: {result['refused']}; " in finding, finding
    record = RunRecord("formats", {}, "", 1, results={"scaled_mm": result})
    assert summary.scaled_mm_lines(record, on_cpu=False) == ["  " + judge.refusal(result)]
    assert finding == f"[kernel] {judge.refusal(result)} (rule fp8-matmul)"

    def crashes(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(CRASHED)

    monkeypatch.setattr(torch, "_scaled_mm", crashes)  # a kernel that fails is an error, not the format refused
    failed = scaled_mm.run("cpu")
    assert "refused" not in failed and failed["error"] == f"RuntimeError: {CRASHED}"
    (raised,) = judge.scaled_mm_problems(RunRecord("formats", {}, "", 1, results={"scaled_mm": failed}))
    assert not isinstance(raised, str) and raised.check == "scaled-mm"
    assert scaled_mm_findings(failed)[0].startswith("[kernel] torch._scaled_mm ")
    assert f"e4m3fnuz on gfx942 raised {failed['error']}" in raised.message


def test_fp4_is_reported_as_going_through_the_scenario_codec() -> None:
    assert device.native_fp4_cast() is False  # torch 2.13: "copy_kernel" not implemented for Float4_e2m1fn_x2
    codes, values = rank.decode_all(FORMATS["e2m1fn"], "cpu")
    assert codes[:4].tolist() == [0, 0, 1, 0] and values[:4].tolist() == [0.0, 0.0, 0.5, 0.0]
    codes16 = np.arange(16, dtype=np.uint8)
    packed = torch.from_numpy(oracle.pack_nibbles(codes16)).view(torch.float4_e2m1fn_x2)  # the file's layout
    assert np.array_equal(device.fp4_encode(device.fp4_decode(device.unpack_fp4(packed))).numpy(), codes16)


def test_the_format_changes_option_takes_fail_or_warn(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", "--gpuregress-format-changes=maybe", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpuregress-format-changes 'maybe': must be one of fail, warn*"])


def test_a_kernel_that_raises_is_a_finding_of_its_case_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    real_cast = device.cast

    def no_e8m0(values: torch.Tensor, fmt: object) -> torch.Tensor:
        if getattr(fmt, "id", "") == "e8m0fnu":
            raise RuntimeError('"copy_kernel" not implemented for Float8_e8m0fnu')
        return real_cast(values, fmt)  # type: ignore[arg-type]

    def no_conversion(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("no kernel for the conversion")

    monkeypatch.setattr(device, "cast", no_e8m0)
    monkeypatch.setattr(device, "fn_to_fnuz", no_conversion)
    cases = [c for c in SCENARIO.cases(CPU) if "e8m0fnu" in c.id or c.id == "quantized-per_tensor_e4m3fn_to_fnuz"]
    ctx = RankContext(0, 1, 0, "cpu", "gloo", SCENARIO.launch_config(CPU, cases), Path(tempfile.mkdtemp()))
    record = SCENARIO.merge([rank.run(ctx)])
    failures = {c.id: [described(p) for p in SCENARIO.own_findings(c, record, CPU)] for c in cases}
    assert failures["decode-e8m0fnu"] == []
    assert failures["encode-e8m0fnu"] == failures["behaviour-e8m0fnu"] == [
        '[format] encode e8m0fnu: raised on cpu: RuntimeError: "copy_kernel" not implemented for Float8_e8m0fnu '
        '(rule format-codec)']
    assert failures["quantized-per_tensor_e4m3fn_to_fnuz"] == [
        "[quantization] per_tensor_e4m3fn_to_fnuz: the round trip raised RuntimeError: no kernel for the conversion "
        "(rule quantized-roundtrip)"]
    assert set(record.results["quantized"]) == {"per_tensor_e4m3fn", "per_tensor_e4m3fn_to_fnuz"}  # and its source
