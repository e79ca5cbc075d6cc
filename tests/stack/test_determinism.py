"""Determinism per platform: strict mode and SDPA routing on GPUs, what is recorded, and the lane it decides.

No GPU here: CUDA and ROCm are emulated by the inputs set_determinism reads (``device_kind``,
``torch.version.hip``); the switches it sets are torch's process-wide flags, which a CPU build has too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpuregress.comparison.compare import choose_lane, compare_training
from pytest_gpuregress.stack import determinism
from pytest_gpuregress.stack.determinism import set_determinism
from pytest_gpuregress.stack.fingerprint import collect, numerics_diff

from ..conftest import make_record, sdpa_switches

SHIPPED = Path(__file__).parents[2] / "reference_runs" / "fsdp" / "cpu-gloo-w2-fp32" / "record.json"
# The numerics fields set_determinism sets: none may differ from the shipped CPU reference's.
DETERMINISM_FIELDS = {"numerics.sdpa_backends", "numerics.tf32_matmul", "numerics.tf32_cudnn", "numerics.num_threads",
                      "numerics.float32_matmul_precision", "numerics.deterministic_algorithms",
                      "numerics.cudnn_deterministic", "numerics.cudnn_benchmark", "numerics.cublas_workspace_config"}


pytestmark = pytest.mark.usefixtures("torch_state")  # tests/conftest.py: set_determinism's state put back


def _as(monkeypatch: pytest.MonkeyPatch, hip: str | None) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)


def _shipped_fingerprint() -> dict[str, Any]:
    return json.loads(SHIPPED.read_text())["fingerprint"]


def test_cpu_keeps_the_values_of_every_recorded_key_and_adds_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # Left in the environment by a ROCm job (or a test): rocBLAS is not used here, so the fingerprint ignores it.
    monkeypatch.setenv("ROCBLAS_DEFAULT_ATOMICS_MODE", "0")
    switches = set_determinism(0, device_kind="cpu")
    recorded = {k.removeprefix("determinism."): v for k, v in _shipped_fingerprint()["numerics"].items()
                if k.startswith("determinism.")}
    added = {"platform": "cpu", "warn_only": False, "sdpa_backends": "cudnn,flash,math,mem_efficient",
             "rocblas_atomics_mode": None, "deterministic": True, "nondeterministic_reason": None}
    assert {k: switches[k] for k in recorded} == recorded  # a reference from before these keys stays exact
    assert {k: switches[k] for k in added} == added and set(switches) == set(recorded) | set(added)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert all(sdpa_switches().values())  # the CPU flash kernel is deterministic: it stays allowed


def test_cuda_is_strict_and_sends_attention_to_the_math_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, None)
    switches = set_determinism(0, device_kind="cuda")
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert sdpa_switches() == {"cudnn": False, "flash": False, "math": True, "mem_efficient": False}
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert switches["platform"] == "cuda" and switches["sdpa_backends"] == "math" and switches["warn_only"] is False
    assert switches["cublas_workspace_config"] == ":4096:8" and switches["tf32"] is False
    assert switches["deterministic"] is True and switches["nondeterministic_reason"] is None
    assert switches["rocblas_atomics_mode"] is None  # set and read on ROCm only
    query = torch.randn(1, 2, 8, 16)  # the same global switches steer the CPU's choice: math, not flash
    assert torch._fused_sdp_choice(query, query, query) == torch.nn.attention.SDPBackend.MATH.value


def test_rocm_is_strict_on_math_attention_and_turns_off_rocblas_atomics(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, "6.4.43482")
    switches = set_determinism(0, device_kind="cuda")
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert sdpa_switches() == {"cudnn": False, "flash": False, "math": True, "mem_efficient": False}
    assert switches["platform"] == "rocm" and switches["rocblas_atomics_mode"] == "0" and switches["deterministic"]


@pytest.mark.parametrize(("hip", "env", "said"), [
    (None, {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=:0:0"),
    ("6.4", {"ROCBLAS_DEFAULT_ATOMICS_MODE": "1"}, "ROCBLAS_DEFAULT_ATOMICS_MODE=1"),
    (None, {determinism.MODE_VARIABLE: "warn"}, "GPUREGRESS_DETERMINISM=warn"),
])
def test_without_determinism_a_gpu_runs_warn_only_and_says_why(
    monkeypatch: pytest.MonkeyPatch, hip: str | None, env: dict[str, str], said: str
) -> None:
    _as(monkeypatch, hip)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    switches = set_determinism(0, device_kind="cuda")
    assert torch.is_deterministic_algorithms_warn_only_enabled() and switches["warn_only"] is True
    assert switches["deterministic"] is False and said in switches["nondeterministic_reason"]
    assert sdpa_switches()["math"] and not sdpa_switches()["flash"]  # still as deterministic as it can be
    [line] = determinism.header_lines("cuda")
    assert "NOT deterministic" in line and said in line and "tolerant lane" in line


def test_the_header_speaks_on_a_gpu_and_stays_as_it_was_on_a_deterministic_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, None)
    assert determinism.header_lines("cpu") == []
    [line] = determinism.header_lines("cuda")
    assert line.startswith("gpuregress determinism (cuda): strict") and "SDPA on math only" in line
    monkeypatch.setenv(determinism.MODE_VARIABLE, "warn")
    assert "NOT deterministic" in determinism.header_lines("cpu")[0]


def test_the_shipped_cpu_reference_keeps_its_numerics_key() -> None:
    shipped = _shipped_fingerprint()
    current = collect("cpu", "gloo", 2, set_determinism(0, device_kind="cpu"))
    changed = {name for name, _, _ in numerics_diff(shipped, current)}
    # What may differ here is this machine and its libraries (CPU model, BLAS, versions), never a switch.
    assert not {n for n in changed if n.startswith("numerics.determinism.")} and not changed & DETERMINISM_FIELDS
    current["versions"], current["device"], current["comm"] = shipped["versions"], shipped["device"], shipped["comm"]
    current["numerics"]["blas"] = shipped["numerics"]["blas"]
    assert numerics_diff(shipped, current) == []  # the new keys, absent from the reference, are ignored


def _gpu_fingerprint(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    _as(monkeypatch, None)
    return {"numerics": {f"determinism.{k}": v for k, v in set_determinism(0, device_kind="cuda").items()}}


@pytest.mark.parametrize(("key", "value"), [
    ("warn_only", True), ("sdpa_backends", "flash,math,mem_efficient"), ("tf32", True),
    ("cublas_workspace_config", ":16:8"), ("rocblas_atomics_mode", "0"), ("deterministic", False),
])
def test_every_determinism_setting_takes_part_in_the_lane(monkeypatch: pytest.MonkeyPatch, key: str, value: Any) -> None:
    reference = _gpu_fingerprint(monkeypatch)
    run = {"numerics": {**reference["numerics"], f"determinism.{key}": value}}
    assert numerics_diff(reference, reference) == []
    assert [name for name, _, _ in numerics_diff(reference, run)] == [f"numerics.determinism.{key}"]


def test_a_run_that_could_not_be_made_deterministic_compares_in_the_tolerant_lane() -> None:
    numerics = {"blas": "mkl", "determinism.deterministic": False,
                "determinism.nondeterministic_reason": "CUBLAS_WORKSPACE_CONFIG=:0:0 was set before the run"}
    run = make_record()
    run.fingerprint = {**run.fingerprint, "numerics": numerics}
    reference = make_record()
    reference.fingerprint = {**reference.fingerprint, "numerics": dict(numerics)}  # unchanged stack, same switches
    lane, reason = choose_lane(reference, run)
    assert lane == "tolerant" and reason.startswith("this run ") and "could not be made deterministic (" in reason
    assert f"({numerics['determinism.nondeterministic_reason']})" in reason  # the recorded reason, carried whole
    assert choose_lane(reference, run, "exact")[0] == "exact"  # an explicit request still wins
    assert "the reference could not" in choose_lane(reference, make_record())[1]  # recorded without determinism
    assert compare_training(reference, run).lane == "tolerant"
    assert choose_lane(make_record(), make_record())[0] == "exact"  # fingerprints without the keys: as before
