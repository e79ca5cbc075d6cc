"""Device facts in the fingerprint: DNN and BLAS library, MIG, driver and firmware, from recorded outputs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.stack import devices
from pytest_gpuregress.stack import fingerprint as fp
from pytest_gpuregress.stack.devices import (
    DEVICE_FIELDS,
    blas_library,
    dnn_version,
    firmware_summary,
    mig_state,
    parse_amd_smi_firmware,
    parse_amd_smi_version,
    parse_nvidia_smi,
    probe_device,
    run_tool,
    smi_facts,
)

REPO = Path(__file__).resolve().parents[2]
CPU_REFERENCE = REPO / "reference_runs" / "fsdp" / "cpu-gloo-w2-fp32" / "record.json"

# nvidia-smi --query-gpu=driver_version,vbios_version,mig.mode.current --format=csv,noheader
NVIDIA_H100 = "570.124.06, 96.00.99.00.01, Disabled\n" * 8
NVIDIA_A100_MIG = "535.104.05, 92.00.45.00.06, Enabled\n535.104.05, 92.00.45.00.06, Enabled\n"
NVIDIA_RTX = "550.54.15, 95.02.3C.00.8E, [N/A]\n"  # no MIG on this GPU
MIG_UUID = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"

# amd-smi version: the text form of amd-smi 24.x (no amdgpu field) and 26.x, and the --json form
AMD_VERSION_MI300X = "AMDSMI Tool: 24.5.1+c5106a9 | AMDSMI Library version: 24.5.2.0 | ROCm version: 6.1.2\n"
AMD_VERSION_MI350 = ("AMDSMI Tool: 26.1.0+cd50d9e0 | AMDSMI Library version: 26.1.0 | ROCm version: 7.1.1 | "
                     "amdgpu version: 6.16.6 | amd_hsmp version: N/A\n")
AMD_VERSION_JSON = json.dumps([{
    "tool": "AMDSMI Tool", "version": "26.2.0+021c61fc", "amdsmi_library_version": "26.2.0",
    "rocm_version": "7.0.2", "amdgpu_version": "6.16.6", "amd_hsmp_driver_version": "N/A",
}], indent=4)


def fw(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"fw_id": name, "fw_version": version} for name, version in pairs]


MI300X_FW = (("CP_MEC1", "177"), ("CP_MEC2", "177"), ("RLC", "95"), ("SDMA", "19"), ("PSP_SOSDRV", "00.36.02.59"),
             ("TA_RAS", "1B.36.02.14"), ("TA_XGMI", "20.00.00.14"), ("PM", "85.112.0"), ("RLC_SRLG", "N/A"))
# amd-smi firmware --json: one object per GPU
AMD_FIRMWARE_MI300X = json.dumps([{"gpu": 0, "fw_list": fw(*MI300X_FW)},
                                  {"gpu": 1, "fw_list": fw(*MI300X_FW)}], indent=4)
# newer releases wrap the GPUs, and amd-smi prints group warnings before the JSON
AMD_FIRMWARE_MI350 = (
    "WARNING: User is missing the following required groups: render, video. Please add user to these groups.\n"
    + json.dumps({"gpu_data": [{"gpu": 0, "fw_list": fw(("CP_MEC1", "36"), ("RLC", "108"), ("PM", "86.11.0"))}]},
                 indent=2)
)


@pytest.fixture(autouse=True)
def fresh_smi_cache() -> Any:
    """smi_facts caches per process: no test may see another's fake tools, nor leave them behind."""
    smi_facts.cache_clear()
    yield
    smi_facts.cache_clear()


# ---- nvidia-smi -----------------------------------------------------------------------------


def test_nvidia_smi_rows_and_placeholders() -> None:
    rows = parse_nvidia_smi(NVIDIA_H100)
    assert len(rows) == 8
    assert rows[0] == {"driver_version": "570.124.06", "vbios_version": "96.00.99.00.01", "mig.mode.current": "Disabled"}
    assert parse_nvidia_smi(NVIDIA_RTX)[0]["mig.mode.current"] is None
    assert parse_nvidia_smi("Failed to initialize NVML: Driver/library version mismatch\n") == []


@pytest.mark.parametrize(("text", "visible", "expected"), [
    (NVIDIA_H100, None, "disabled"),
    (NVIDIA_H100, "0,1,2,3", "disabled"),
    (NVIDIA_A100_MIG, None, "enabled"),
    (NVIDIA_A100_MIG, MIG_UUID, f"enabled, instance {MIG_UUID}"),
    (NVIDIA_A100_MIG, "MIG-GPU-8eaaebb8-bb64-8489-fda2-62256e821983/1/0",
     "enabled, instance MIG-GPU-8eaaebb8-bb64-8489-fda2-62256e821983/1/0"),
    (NVIDIA_RTX, None, None),
    ("", MIG_UUID, f"enabled, instance {MIG_UUID}"),
])
def test_mig_state(text: str, visible: str | None, expected: str | None) -> None:
    modes = [row["mig.mode.current"] for row in parse_nvidia_smi(text)]
    assert mig_state(modes, visible) == expected


def fake_tools(monkeypatch: pytest.MonkeyPatch, outputs: dict[str, str | None]) -> list[tuple[str, ...]]:
    """run_tool answers from ``outputs`` (keyed by the joined argv); unknown commands fail."""
    calls: list[tuple[str, ...]] = []

    def run(argv: tuple[str, ...], timeout: float = devices.SMI_TIMEOUT_S) -> str | None:
        calls.append(tuple(argv))
        return outputs.get(" ".join(argv))

    monkeypatch.setattr(devices, "run_tool", run)
    smi_facts.cache_clear()  # facts read with other tools must not answer
    return calls


NVIDIA_CMD = "nvidia-smi --query-gpu=driver_version,vbios_version,mig.mode.current --format=csv,noheader"
NVIDIA_OLD_CMD = "nvidia-smi --query-gpu=driver_version,vbios_version --format=csv,noheader"


def test_smi_facts_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(monkeypatch, {NVIDIA_CMD: NVIDIA_A100_MIG})
    assert smi_facts(False) == ("535.104.05", "vbios 92.00.45.00.06", ("Enabled", "Enabled"))


def test_smi_facts_nvidia_driver_without_mig_field(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_tools(monkeypatch, {NVIDIA_OLD_CMD: "470.82.01, 86.00.4D.00.04\n"})
    assert smi_facts(False) == ("470.82.01", "vbios 86.00.4D.00.04", (None,))
    assert [" ".join(c) for c in calls] == [NVIDIA_CMD, NVIDIA_OLD_CMD]


def test_smi_facts_are_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_tools(monkeypatch, {NVIDIA_CMD: NVIDIA_H100})
    smi_facts(False)
    smi_facts(False)
    assert len(calls) == 1


# ---- amd-smi --------------------------------------------------------------------------------


def test_amd_smi_version_text_and_json() -> None:
    assert parse_amd_smi_version(AMD_VERSION_MI350) == {
        "amdsmi": "26.1.0+cd50d9e0", "amdsmi_library": "26.1.0", "rocm": "7.1.1", "amdgpu": "6.16.6"}
    assert "amdgpu" not in parse_amd_smi_version(AMD_VERSION_MI300X)
    assert parse_amd_smi_version(AMD_VERSION_MI300X)["rocm"] == "6.1.2"
    assert parse_amd_smi_version(AMD_VERSION_JSON) == {
        "amdsmi": "26.2.0+021c61fc", "amdsmi_library": "26.2.0", "rocm": "7.0.2", "amdgpu": "6.16.6"}
    assert parse_amd_smi_version("") == {}


def test_amd_smi_firmware_shapes() -> None:
    mi300x = parse_amd_smi_firmware(AMD_FIRMWARE_MI300X)
    assert list(mi300x) == [name for name, version in MI300X_FW if version != "N/A"]
    assert mi300x["PM"] == "85.112.0"
    assert parse_amd_smi_firmware(AMD_FIRMWARE_MI350) == {"CP_MEC1": "36", "RLC": "108", "PM": "86.11.0"}
    wrapped = json.dumps([{"gpu": 0, "fw_list": [{"FW 0": {"fw_id": "CP_MEC1", "fw_version": 36}}]}])
    assert parse_amd_smi_firmware(wrapped) == {"CP_MEC1": "36"}
    assert parse_amd_smi_firmware(json.dumps([{"gpu": 0, "fw_list": "N/A"}])) == {}
    assert parse_amd_smi_firmware("not json [at all") == {}
    assert firmware_summary({"CP_MEC1": "36", "RLC": "108"}) == "CP_MEC1 36, RLC 108"
    assert firmware_summary({}) is None


def test_smi_facts_amd(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(monkeypatch, {"amd-smi version": AMD_VERSION_MI350, "amd-smi firmware -g 0 --json": AMD_FIRMWARE_MI350})
    assert smi_facts(True) == ("6.16.6", "CP_MEC1 36, RLC 108, PM 86.11.0", ())
    fake_tools(monkeypatch, {"amd-smi version": AMD_VERSION_MI300X})
    assert smi_facts(True) == (None, None, ())  # the driver then comes from /sys/module/amdgpu/version


# ---- DNN and BLAS library -------------------------------------------------------------------


@pytest.mark.parametrize(("value", "is_rocm", "expected"), [
    (90100, False, "cuDNN 9.1.0"),
    (91001, False, "cuDNN 9.10.1"),
    (8907, False, "cuDNN 8.9.7"),
    (7605, False, "cuDNN 7.6.5"),
    (3002000, True, "MIOpen 3.2.0"),  # torch: MAJOR*1000000 + MINOR*1000 + PATCH
    (3004002, True, "MIOpen 3.4.2"),
    (30200, True, "MIOpen 3.2.0"),
    (None, False, None),
    (0, True, None),
    (True, False, None),
])
def test_dnn_version(value: object, is_rocm: bool, expected: str | None) -> None:
    assert dnn_version(value, is_rocm) == expected


def test_blas_library_names() -> None:
    import torch

    backend = torch._C._BlasBackend
    assert blas_library(backend.Cublas, False) == "cuBLAS"
    assert blas_library(backend.Cublaslt, False) == "cuBLASLt"
    assert blas_library(backend.Cublas, True) == "rocBLAS"
    assert blas_library(backend.Cublaslt, True) == "hipBLASLt"
    assert blas_library(backend.Ck, True) == "CK"
    assert blas_library("hipblaslt", True) == "hipBLASLt"


@pytest.mark.parametrize(("env", "is_rocm", "expected"), [
    ({"TORCH_BLAS_PREFER_HIPBLASLT": "1"}, True, "hipBLASLt"),
    ({"TORCH_BLAS_PREFER_HIPBLASLT": "0"}, True, "rocBLAS"),
    ({"TORCH_BLAS_PREFER_CUBLASLT": "1"}, False, "cuBLASLt"),
    ({}, False, None),
])
def test_blas_library_without_a_getter_reads_the_variables(env: dict[str, str], is_rocm: bool, expected: str | None) -> None:
    assert blas_library(None, is_rocm, env) == expected


# ---- probes never raise ---------------------------------------------------------------------


def test_a_missing_tool_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices.shutil, "which", lambda name: None)
    assert run_tool(("nvidia-smi", "-L")) is None


def test_a_failing_or_slow_tool_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_tool(("false",)) is None
    assert run_tool(("sleep", "5"), timeout=0.2) is None
    assert run_tool(("echo", "ok")) == "ok\n"

    def broken(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(devices.subprocess, "run", broken)
    assert run_tool(("echo", "ok")) is None


def test_a_timeout_inside_subprocess_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args: Any, **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(cmd="amd-smi", timeout=2)

    monkeypatch.setattr(devices.subprocess, "run", slow)
    assert run_tool(("echo", "ok")) is None


def fake_torch(hip: str | None = None, cudnn: Any = 90100, blas: Any = "Cublaslt") -> Any:
    def value_or_raise(value: Any) -> Any:
        def call() -> Any:
            if isinstance(value, Exception):
                raise value
            return value
        return call

    props = SimpleNamespace(major=9, minor=0, gcnArchName="gfx950:sramecc+:xnack-")
    return SimpleNamespace(
        version=SimpleNamespace(hip=hip, cuda=None if hip else "12.8"),
        backends=SimpleNamespace(
            cudnn=SimpleNamespace(version=value_or_raise(cudnn)),
            cuda=SimpleNamespace(preferred_blas_library=value_or_raise(blas)),
            cpu=SimpleNamespace(get_cpu_capability=lambda: "AVX512"),
        ),
        cuda=SimpleNamespace(is_available=lambda: True, get_device_name=lambda i=0: "GPU", device_count=lambda: 8,
                             get_device_properties=lambda i=0: props),
    )


def test_probe_device_with_nothing_readable_gives_nones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices.shutil, "which", lambda name: None)
    torch = fake_torch(cudnn=RuntimeError("cuDNN version incompatibility"), blas=RuntimeError("no CUDA"))
    assert probe_device(torch) == {"dnn": None, "blas_library": None, "mig": None, "driver": None, "firmware": None}


def test_probe_device_when_the_smi_facts_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(is_rocm: bool) -> None:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(devices, "smi_facts", boom)
    assert probe_device(fake_torch())["driver"] is None


def test_probe_device_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(monkeypatch, {"amd-smi version": AMD_VERSION_MI350, "amd-smi firmware -g 0 --json": AMD_FIRMWARE_MI350})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)  # not read on ROCm: no MIG there
    assert probe_device(fake_torch(hip="7.1.52802-26aae437f6", cudnn=3004000)) == {
        "dnn": "MIOpen 3.4.0", "blas_library": "hipBLASLt", "mig": None, "driver": "6.16.6",
        "firmware": "CP_MEC1 36, RLC 108, PM 86.11.0"}


def test_the_device_section_on_a_mig_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(monkeypatch, {NVIDIA_CMD: NVIDIA_A100_MIG})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)
    monkeypatch.setattr(fp, "_driver_version", lambda torch: "should not be used")
    section = fp._device_section(fake_torch(), "cuda")
    assert section["driver"] == "535.104.05"  # the SMI value, same form as /proc/driver/nvidia/version's
    assert section["dnn"] == "cuDNN 9.1.0" and section["blas_library"] == "cuBLASLt"
    assert section["mig"] == f"enabled, instance {MIG_UUID}" and section["firmware"] == "vbios 92.00.45.00.06"
    assert section["arch"] == "sm_90"


def test_the_device_section_falls_back_to_the_kernel_driver_version(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(monkeypatch, {})
    monkeypatch.setattr(fp, "_driver_version", lambda torch: "6.8.5")
    section = fp._device_section(fake_torch(hip="6.4.43482-0f2d60242", cudnn=3004000), "cuda")
    assert section["driver"] == "6.8.5" and section["firmware"] is None and section["mig"] is None


# ---- CPU runs and old references ------------------------------------------------------------


def test_a_cpu_device_section_has_the_new_fields_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def never(*args: Any) -> None:
        raise AssertionError("a CPU run must not probe GPU tools")

    monkeypatch.setattr(fp, "probe_device", never)
    section = fp._device_section(torch, "cpu")
    assert {name: section[name] for name in DEVICE_FIELDS} == dict.fromkeys(DEVICE_FIELDS)


def test_an_old_cpu_reference_keeps_its_lane() -> None:
    new = json.loads(CPU_REFERENCE.read_text())["fingerprint"]  # the shipped one: recorded with the fields, None
    assert all(new["device"][name] is None for name in DEVICE_FIELDS)
    old = copy.deepcopy(new)  # as a reference recorded before the fields existed
    for name in DEVICE_FIELDS:
        del old["device"][name]
    assert fp.numerics_key(new) == fp.numerics_key(old)
    assert fp.numerics_diff(old, new) == [] and fp.numerics_diff(new, old) == []
    assert fp.diff(old, new) == []


def test_dnn_and_blas_library_choose_the_lane_but_mig_and_firmware_do_not() -> None:
    assert {"dnn", "blas_library"} <= set(fp.NUMERICS_FIELDS["device"])
    assert not {"mig", "firmware"} & set(fp.NUMERICS_FIELDS["device"])
    old = json.loads(CPU_REFERENCE.read_text())["fingerprint"]
    old["device"].update(dict.fromkeys(DEVICE_FIELDS))  # recorded by this version: the fields are there
    gpu = copy.deepcopy(old)
    gpu["device"].update(dnn="cuDNN 9.1.0", mig="enabled", firmware="vbios 1")
    assert [name for name, _, _ in fp.numerics_diff(old, gpu)] == ["device.dnn"]


def test_the_header_shows_the_new_fields_only_when_recorded() -> None:
    old = json.loads(CPU_REFERENCE.read_text())["fingerprint"]
    cpu = copy.deepcopy(old)
    cpu["device"].update(dict.fromkeys(DEVICE_FIELDS))
    assert fp.header_lines(cpu) == fp.header_lines(old)
    title, _, device = fp.header_lines(cpu)[1].partition(": ")
    assert title == "gpuregress device"
    assert device.split("; ") == ["cpu AMD EPYC [AVX2]", "no accelerator runtime", "nccl -"]
    gpu = copy.deepcopy(old)
    gpu["device"].update(kind="cuda", name="NVIDIA A100-SXM4-40GB MIG 1g.5gb", count=1, arch="sm_80", cuda="12.8",
                         driver="535.104.05", dnn="cuDNN 9.1.0", blas_library="cuBLASLt",
                         mig=f"enabled, instance {MIG_UUID}", firmware="vbios 92.00.45.00.06")
    title, _, line = fp.header_lines(gpu)[1].partition(": ")
    device, runtime, nccl = line.split("; ")
    assert (title, device, nccl) == ("gpuregress device", f"{gpu['device']['name']} x1 (sm_80)", "nccl -")
    assert runtime.split(", ") == ["cuda 12.8", "driver 535.104.05", "cuDNN 9.1.0", "blas cuBLASLt", "MIG enabled",
                                   f"instance {MIG_UUID}", "firmware vbios 92.00.45.00.06"]


def test_a_field_added_after_a_reference_was_recorded_does_not_change_its_lane() -> None:
    from pytest_gpuregress.stack.fingerprint import numerics_diff

    old_gpu = {"versions": {"torch": "2.13.0"}, "device": {"kind": "cuda", "name": "NVIDIA H200", "driver": "570.1"},
               "numerics": {}, "comm": {}}
    new_gpu = {**old_gpu, "device": {**old_gpu["device"], "dnn": "cuDNN 9.10.0", "blas_library": "cuBLASLt"}}
    assert numerics_diff(old_gpu, new_gpu) == []  # recorded before dnn and blas_library existed: exact lane kept
    moved = {**new_gpu, "device": {**new_gpu["device"], "dnn": "cuDNN 9.11.0"}}
    assert numerics_diff(new_gpu, moved) == [("device.dnn", "cuDNN 9.10.0", "cuDNN 9.11.0")]


def test_a_bf16_run_on_a_cpu_reads_its_bf16_instructions_and_an_fp32_run_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN picks its bf16 instructions itself: a bf16 reference recorded with AVX512-BF16 computes other bits
    than an AVX2 CPU, even under ATEN_CPU_CAPABILITY=avx2, so that must choose the tolerant lane."""
    from pytest_gpuregress.stack import fingerprint as fp

    bf16 = fp.collect("cpu", "gloo", 2, bf16=True)
    assert bf16["device"]["cpu_bf16"] in ("amx_bf16", "avx512_bf16", "none")
    assert "cpu_bf16" not in fp.collect("cpu", "gloo", 2)["device"]
    other = {**bf16, "device": {**bf16["device"], "cpu_bf16": "none" if bf16["device"]["cpu_bf16"] != "none" else "avx512_bf16"}}
    assert [c[0] for c in fp.numerics_diff(bf16, other)] == ["device.cpu_bf16"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = fp.cpu_bf16()
    assert capped == "none" or capped.endswith("(max ISA AVX2)")


def test_the_recorders_dump_locations_and_switches_are_never_recorded(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin arms torch's flight recorder for each launch in that launch's own run folder: a fingerprint that
    recorded it would leave the exact lane between any two runs. What changes numbers stays recorded."""
    from pytest_gpuregress.launch import torch_trace
    from pytest_gpuregress.stack.fingerprint import collect

    for name in (*torch_trace.FILE_VARS, *torch_trace.BUFFER_VARS, torch_trace.DUMP_VAR, torch_trace.ARMED_VAR,
                 torch_trace.TIMING_VAR):  # what arm() sets in os.environ, put back by monkeypatch afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in ("NCCL_PROTO", "NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.setenv(name, {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}.get(name, ":4096:8"))
    fingerprints = []
    for run in ("run1", "run2"):
        torch_trace.arm(tmp_path / run, "nccl")  # os.environ, as a rank's worker does
        fingerprints.append(collect("cpu", "gloo", 2))
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path / "run2"))
    assert fingerprints[0] == fingerprints[1]
    env = fingerprints[0]["comm"]["env"]
    assert env["NCCL_PROTO"] == "Simple" and env["NCCL_ALGO"] == "Ring"
    assert fingerprints[0]["numerics"]["cublas_workspace_config"] == ":4096:8"
    for name in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_ENABLE_TIMING",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE", torch_trace.ARMED_VAR):
        assert name not in env


@pytest.mark.parametrize("name", ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE",
                                  "TORCH_NCCL_ENABLE_TIMING", "TORCH_FR_BUFFER_SIZE", "NCCL_DEBUG_FILE",
                                  "RCCL_MSCCL_LOG_PATH", "NCCL_SOME_FUTURE_TRACE_DIR"])
def test_gpuregress_env_leaves_out_dump_trace_and_timing_variables(name: str, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_gpuregress.cli import main

    monkeypatch.setenv(name, "/tmp/somewhere")
    monkeypatch.setenv("RCCL_LL128_FORCE_ENABLE", "1")  # this one changes which protocol runs: recorded
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)["comm"]["env"]
    assert name not in env and env["RCCL_LL128_FORCE_ENABLE"] == "1"


def test_the_whole_environment_is_recorded_and_what_changed_names_packages_by_name() -> None:
    """transformers 5.25 brought a new package, kernels, which can replace a module's forward with a hub kernel:
    what changed must name it as added. A new tokenizer keeps the exact lane; a package that computes leaves it."""
    recorded = fp.collect("cpu", "gloo", 2)
    packages = recorded["packages"]
    assert packages["torch"].startswith("2.") and packages["numpy"] and len(packages) > 10
    assert packages["pytest-gpuregress"].endswith("(editable)")  # this checkout's own install
    before = copy.deepcopy(recorded)
    after = copy.deepcopy(recorded)
    after["versions"]["transformers"] = "5.25.0"
    after["packages"].update(transformers="5.25.0", kernels="0.19.1", tokenizers="9.9.9")
    after["packages"].pop("pyyaml", None)
    described = [fp.describe_change(*c) for c in fp.diff(before, after)]
    assert "kernels 0.19.1 added (can change computation)" in described
    assert f"tokenizers {before['packages']['tokenizers']} -> 9.9.9" in described
    assert "transformers 5.24.0 -> 5.25.0" in described or any(d.startswith("transformers ") for d in described)
    assert sum(d.startswith("transformers ") for d in described) == 1  # said once, in the versions section
    assert "kernels 0.19.1 added" in fp.summarize_changes(fp.diff(before, after), others_shown=0)
    # The exact lane: a tokenizer or a logger that moved keeps it; a package that computes leaves it.
    only_tokenizers = copy.deepcopy(before)
    only_tokenizers["packages"]["tokenizers"] = "9.9.9"
    assert fp.numerics_diff(before, only_tokenizers) == []
    with_kernels = copy.deepcopy(before)
    with_kernels["packages"]["kernels"] = "0.19.1"
    assert fp.numerics_diff(before, with_kernels) == [("packages.kernels", None, "0.19.1")]
