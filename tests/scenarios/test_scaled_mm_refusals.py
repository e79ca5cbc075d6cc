"""Who said no to torch._scaled_mm, on the CPU with a patched _scaled_mm raising what the GPU builds raise.

torch's own argument checks (aten/src/ATen/native/cuda/ScaledBlas.cpp, _scaled_mm_out_cuda, and older releases)
judge the plugin's call: the test fails as the plugin's error, never as a finding against the vendor. Only a
message that the format or the device is not supported, or one that names the format, is the stack refusing it.
"""

from __future__ import annotations

import re

import pytest
import torch

from pytest_gpuregress.errors import CallRejected
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import Case, Setup
from pytest_gpuregress.scenarios.formats import SCENARIO, judge, scaled_mm, summary
from pytest_gpuregress.scenarios.formats.catalog import FORMATS
from pytest_gpuregress.triage.naming import component_of, described

CUDA = Setup("cuda", "nccl", 1)
CASE = Case("scaled_mm", data={"part": "scaled_mm"})

# What torch says when the call is wrong: shapes, strides, dtypes, layout, scales.
CALL_ERRORS = [
    (RuntimeError, "mat1 must be a matrix"),
    (RuntimeError, "mat1 and mat2 shapes cannot be multiplied (64x128 and 48x128)"),
    (RuntimeError, "mat2 must be col_major"),  # torch 2.1 - 2.4
    (RuntimeError, "Expected both dimensions of mat2 to be divisble by 16"),  # sic, torch 2.1 - 2.4
    (RuntimeError, "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (64x120)."),
    (RuntimeError, "mat2 shape (128x40) must be divisible by 16"),
    (RuntimeError, "scale_a must be float scalar"),
    (RuntimeError, "scale_a must have 1 Float element"),
    (RuntimeError, "expected scale_a.stride(1) to be 1, but got 64"),
    (RuntimeError, "out_dtype must match output matrix type"),
    (RuntimeError, "Expected mat2 to be Float8 or Float4_x2 matrix got Float"),
    (RuntimeError, "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"),
    (RuntimeError, "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"),
    # TORCH_CHECK_VALUE: a ValueError in torch 2.13, and it names the format, yet it judges the call.
    (ValueError, "Invalid scaling configuration.\n- For TensorWise scaling, a and b should be float8, scales should be "
                 "float and singletons.\nGot a.dtype()=Float8_e4m3fnuz, scale_a.dtype()=Double, scale_a.size()=[]"),
    (TypeError, "_scaled_mm() got an unexpected keyword argument 'out_dtype'"),
]
# The stack turning the format or this device down: a finding about the stack.
REFUSALS = [
    (RuntimeError, "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, "
                   "or ROCm MI300+"),
    (RuntimeError, "Float8_e4m3fn is only supported for ROCm 6.5 and above"),
    (RuntimeError, "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul( ...)`"),
    (RuntimeError, "hipblaslt error: unsupported data type for gfx942"),
    (RuntimeError, "Block-wise scaling for Float8_e8m0fnu requires ROCm 7.0 or later"),
    (RuntimeError, "itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor inputFloat8_e4m3fnuz"),
    (RuntimeError, "no fp8 kernel for sm_89 in this build"),
    (NotImplementedError, "Could not run 'aten::_scaled_mm' with arguments from the 'CUDA' backend."),
]
# The kernel failing: reported as the run's error, as before.
KERNEL_ERRORS = [
    (RuntimeError, "CUDA error: an illegal memory access was encountered"),
    (RuntimeError, "CUDA error: invalid argument"),
    (RuntimeError, "CUDA out of memory. Tried to allocate 2.00 MiB"),
]


def raising(kind: type[Exception], message: str):  # noqa: ANN201 - a stand-in for torch._scaled_mm
    def fake(*args: object, **kwargs: object) -> torch.Tensor:
        raise kind(message)

    return fake


def run_on_gpu(monkeypatch: pytest.MonkeyPatch, kind: type[Exception], message: str, fmt: str = "e4m3fnuz",
               arch: str = "gfx942") -> dict[str, object]:
    """The rank's entry as on a GPU of ``arch``, with _scaled_mm raising ``message``."""
    monkeypatch.setattr(scaled_mm, "fp8_matmul_format", lambda dev: (FORMATS[fmt], arch))
    monkeypatch.setattr(torch, "_scaled_mm", raising(kind, message))
    return scaled_mm.run("cpu")


def record_of(result: dict[str, object]) -> RunRecord:
    return RunRecord("formats", {}, "", 1, results={"scaled_mm": result})


@pytest.mark.parametrize(("kind", "message"), CALL_ERRORS)
def test_torchs_argument_checks_are_the_plugins_error_not_a_finding(
        monkeypatch: pytest.MonkeyPatch, kind: type[Exception], message: str) -> None:
    result = run_on_gpu(monkeypatch, kind, message)
    assert "refused" not in result and "error" not in result
    assert result["call_rejected"] == f"{kind.__name__}: {message}"
    with pytest.raises(CallRejected) as raised:
        SCENARIO.own_findings(CASE, record_of(result), CUDA)
    text = str(raised.value)
    called = re.match(r"the plugin called torch._scaled_mm wrongly for (\w+) (\[[\d, ]+\]) on (\w+): ", text)
    assert called is not None and called.groups() == ("e4m3fnuz", "[64, 128, 48]", "gfx942"), text
    assert message in text and "bug of pytest-gpuregress" in text and "[kernel]" not in text
    assert summary.scaled_mm_lines(record_of(result), on_cpu=False) == [f"  {text}"]


@pytest.mark.parametrize(("kind", "message"), REFUSALS)
def test_the_stack_refusing_the_format_or_the_device_is_a_finding(
        monkeypatch: pytest.MonkeyPatch, kind: type[Exception], message: str) -> None:
    result = run_on_gpu(monkeypatch, kind, message)
    assert result["refused"] == f"{kind.__name__}: {message}"
    (problem,) = SCENARIO.own_findings(CASE, record_of(result), CUDA)
    assert not isinstance(problem, str) and problem.check == "scaled-mm" and component_of(problem) == "kernel"
    assert problem.message == judge.refusal(result)
    refused = re.match(r"this stack's torch._scaled_mm does not accept (\w+) on (\w+): (.+?); ", problem.message)
    assert refused is not None and refused.groups() == ("e4m3fnuz", "gfx942", result["refused"]), problem.message
    assert described(problem).startswith("[kernel] this stack's ")


@pytest.mark.parametrize(("kind", "message"), KERNEL_ERRORS)
def test_a_failing_kernel_is_still_the_runs_error(monkeypatch: pytest.MonkeyPatch, kind: type[Exception],
                                                  message: str) -> None:
    result = run_on_gpu(monkeypatch, kind, message, "e4m3fn", "sm_90")
    assert result["error"] == f"{kind.__name__}: {message}" and "call_rejected" not in result
    (problem,) = SCENARIO.own_findings(CASE, record_of(result), CUDA)
    assert not isinstance(problem, str) and problem.check == "scaled-mm" and component_of(problem) == "kernel"
    raised = re.fullmatch(r"torch._scaled_mm (\w+) on (\w+) raised (.+)", problem.message)
    assert raised is not None and raised.groups() == ("e4m3fn", "sm_90", result["error"]), problem.message
    assert described(problem).startswith("[kernel] torch._scaled_mm ")


def test_the_real_cpu_argument_checks_are_classified_as_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.13's own CPU _scaled_mm, called wrongly (B row-major, so the shapes do not multiply), says so."""
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: real(a, b.t(), **kw))
    result = scaled_mm.check("cpu", FORMATS["e4m3fn"])
    # _scaled_mm's own check ("mat_a and mat_b") or, where CPU dispatch reaches a matmul first, addmm's ("mat1 and mat2")
    assert re.fullmatch(r"RuntimeError: mat(_a|1) and mat(_b|2) shapes cannot be multiplied.*", result["call_rejected"])
    assert judge.call_rejected({**result, "arch": "cpu"}).endswith("please report it")
