"""The SMI probes through the vendors' Python bindings (fake ``pynvml`` and ``amdsmi`` modules in sys.modules): the
same fingerprint fields and device identities as the tools' recorded output gives, no tool run; and the tools, with
their longer timeout, where the binding cannot be imported or its library does not start."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.stack import device_identity as identity
from pytest_gpuregress.stack import devices, smi_bindings

# What the tools print for the node the fakes describe (the recordings of test_fingerprint_devices/test_consensus).
NVIDIA_FACTS = "535.104.05, 92.00.45.00.06, Enabled\n535.104.05, 92.00.45.00.06, Disabled\n"
NVIDIA_IDS = ("0, 00000000:18:00.0, GPU-5e2b1a8c-1111-2222-3333-444455556666, 1652823045678, NVIDIA H100 80GB HBM3, "
              "92.00.45.00.06\n1, 00000000:2A:00.0, GPU-7f00aa00-1111-2222-3333-444455556666, [N/A], "
              "NVIDIA H100 80GB HBM3, 92.00.45.00.06\n")
AMD_VERSION = ("AMDSMI Tool: 26.1.0+cd50d9e0 | AMDSMI Library version: 26.1.0 | ROCm version: 7.1.1 | "
               "amdgpu version: 6.16.6 | amd_hsmp version: N/A\n")
AMD_FIRMWARE = json.dumps({"gpu_data": [{"gpu": 0, "fw_list": [
    {"fw_id": "CP_MEC1", "fw_version": "36"}, {"fw_id": "RLC", "fw_version": "108"},
    {"fw_id": "RLC_SRLG", "fw_version": "N/A"}, {"fw_id": "PM", "fw_version": "86.11.0"}]}]})
AMD_LIST = json.dumps([{"gpu": 0, "bdf": "0000:0c:00.0", "uuid": "28ff74a1-0000-1000-803c-3b7a6ea8fd0d"},
                       {"gpu": 1, "bdf": "0000:22:00.0", "uuid": "2aff74a1-0000-1000-80f3-16a0e5d1ea48"}])
AMD_ASIC = json.dumps([{"gpu": 0, "asic": {"asic_serial": "0x9D4C2F1A0B3E5D71"}}, {"gpu": 1, "asic": {"asic_serial": "N/A"}}])
TOOLS = {
    f"nvidia-smi --query-gpu={','.join(devices.NVIDIA_QUERY)} --format=csv,noheader": NVIDIA_FACTS,
    f"nvidia-smi --query-gpu={','.join(identity.NVIDIA_ID_QUERY)} --format=csv,noheader": NVIDIA_IDS,
    "amd-smi version": AMD_VERSION, "amd-smi firmware -g 0 --json": AMD_FIRMWARE,
    "amd-smi list --json": AMD_LIST, "amd-smi static --asic --json": AMD_ASIC,
}


class NVMLError(Exception):
    pass


def fake_pynvml(*, init_fails: bool = False) -> ModuleType:
    """NVML of a node with two H100s, the first in MIG mode; the second has no serial (NVML: not supported).
    Old bindings return bytes: the first GPU's name and bus id are bytes."""
    gpus = [{"name": b"NVIDIA H100 80GB HBM3", "uuid": "GPU-5e2b1a8c-1111-2222-3333-444455556666",
             "serial": "1652823045678", "bus": b"00000000:18:00.0", "mig": [1, 1]},
            {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-7f00aa00-1111-2222-3333-444455556666",
             "serial": None, "bus": "00000000:2A:00.0", "mig": [0, 0]}]
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise NVMLError("NVML Shared Library Not Found")

    def serial(h: int) -> str:
        if gpus[h]["serial"] is None:
            raise NVMLError("Not Supported")
        return str(gpus[h]["serial"])

    module = ModuleType("pynvml")
    module.__dict__.update(
        calls=calls, nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: "535.104.05", nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetName=lambda h: gpus[h]["name"], nvmlDeviceGetUUID=lambda h: gpus[h]["uuid"],
        nvmlDeviceGetSerial=serial, nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=gpus[h]["bus"]),
        nvmlDeviceGetVbiosVersion=lambda h: "92.00.45.00.06", nvmlDeviceGetMigMode=lambda h: gpus[h]["mig"])
    return module


class AmdSmiFwBlock(enum.IntEnum):
    AMDSMI_FW_ID_CP_MEC1 = 1
    AMDSMI_FW_ID_RLC = 2
    AMDSMI_FW_ID_RLC_SRLG = 3
    AMDSMI_FW_ID_PM = 4


def fake_amdsmi(*, init_fails: bool = False) -> ModuleType:
    """AMD SMI of a node with two MI300X; the second has no serial."""
    bdfs = ["0000:0c:00.0", "0000:22:00.0"]
    uuids = ["28ff74a1-0000-1000-803c-3b7a6ea8fd0d", "2aff74a1-0000-1000-80f3-16a0e5d1ea48"]
    serials = ["0x9D4C2F1A0B3E5D71", "N/A"]

    def init() -> None:
        if init_fails:
            raise RuntimeError("AMDSMI_STATUS_DRIVER_NOT_LOADED")

    firmware = {"fw_list": [{"fw_name": AmdSmiFwBlock.AMDSMI_FW_ID_CP_MEC1, "fw_version": "36"},
                            {"fw_name": AmdSmiFwBlock.AMDSMI_FW_ID_RLC, "fw_version": "108"},
                            {"fw_name": AmdSmiFwBlock.AMDSMI_FW_ID_RLC_SRLG, "fw_version": "N/A"},
                            {"fw_name": AmdSmiFwBlock.AMDSMI_FW_ID_PM, "fw_version": "86.11.0"}]}
    module = ModuleType("amdsmi")
    module.__dict__.update(
        amdsmi_init=init, amdsmi_shut_down=lambda: None, amdsmi_get_processor_handles=lambda: [0, 1],
        amdsmi_get_gpu_device_bdf=lambda h: bdfs[h], amdsmi_get_gpu_device_uuid=lambda h: uuids[h],
        amdsmi_get_gpu_asic_info=lambda h: {"asic_serial": serials[h]},
        amdsmi_get_gpu_driver_info=lambda h: {"driver_name": "amdgpu", "driver_version": "6.16.6"},
        amdsmi_get_fw_info=lambda h: firmware)
    return module


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    """Every probe is cached per process: no test may see another's fakes, nor leave them behind."""
    def clear() -> None:
        smi_bindings.forget()
        devices.smi_facts.cache_clear()
        identity.smi_devices.cache_clear()
        identity.nvidia_topology.cache_clear()
        devices._HUNG.clear()

    clear()
    yield
    clear()


def tools(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """run_tool answers from TOOLS; the commands run, for the test to see."""
    calls: list[str] = []

    def run(argv: tuple[str, ...], timeout: float = devices.SMI_TIMEOUT_S) -> str | None:
        calls.append(" ".join(argv))
        return TOOLS.get(" ".join(argv))

    monkeypatch.setattr(devices, "run_tool", run)
    monkeypatch.setattr(identity, "run_tool", run)
    return calls


def probed(is_rocm: bool) -> tuple[Any, tuple[identity.SmiDevice, ...]]:
    devices.smi_facts.cache_clear()
    identity.smi_devices.cache_clear()
    return devices.smi_facts(is_rocm), identity.smi_devices(is_rocm)


def absent(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """``import <name>`` fails, whatever this environment has installed."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError on import


@pytest.mark.parametrize("is_rocm", [False, True])
def test_the_bindings_give_what_the_tools_give(monkeypatch: pytest.MonkeyPatch, is_rocm: bool) -> None:
    calls = tools(monkeypatch)
    absent(monkeypatch, "pynvml", "amdsmi")
    from_tools = probed(is_rocm)
    assert calls  # the tools answered the first probe
    assert from_tools[0][0] is not None and len(from_tools[1]) == 2
    calls.clear()
    smi_bindings.forget()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    assert probed(is_rocm) == from_tools  # the fingerprint's fields and the devices' identities, unchanged
    assert calls == []  # and no tool was run


def test_nvml_values_in_the_tools_words(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert devices.smi_facts(False) == ("535.104.05", "vbios 92.00.45.00.06", ("Enabled", "Disabled"))
    first, second = identity.smi_devices(False)
    assert first == identity.SmiDevice(0, "0000:18:00.0", "GPU-5e2b1a8c-1111-2222-3333-444455556666", "1652823045678",
                                       "NVIDIA H100 80GB HBM3", "vbios 92.00.45.00.06")
    assert second.serial is None and second.bus_id == "0000:2a:00.0"
    assert nvml.calls == ["init", "shutdown"]  # once per process, for both probes


def test_amd_values_in_the_tools_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    assert devices.smi_facts(True) == ("6.16.6", "CP_MEC1 36, RLC 108, PM 86.11.0", ())
    assert identity.smi_devices(True) == (
        identity.SmiDevice(0, "0000:0c:00.0", "28ff74a1-0000-1000-803c-3b7a6ea8fd0d", "0x9D4C2F1A0B3E5D71"),
        identity.SmiDevice(1, "0000:22:00.0", "2aff74a1-0000-1000-80f3-16a0e5d1ea48", None))


@pytest.mark.parametrize("is_rocm", [False, True])
def test_a_binding_that_does_not_start_falls_back_to_the_tool(monkeypatch: pytest.MonkeyPatch, is_rocm: bool) -> None:
    """A binding installed where its library does not start (no driver, driver not loaded): the tool is asked."""
    calls = tools(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_fails=True))
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(init_fails=True))
    facts, listed = probed(is_rocm)
    assert facts[0] == ("6.16.6" if is_rocm else "535.104.05") and len(listed) == 2
    assert all(c.startswith("amd-smi" if is_rocm else "nvidia-smi") for c in calls) and len(calls) >= 2


def fake_run(monkeypatch: pytest.MonkeyPatch, outcome: str) -> list[float]:
    """subprocess.run for a tool that is installed and answers, or hangs past its timeout; the timeouts given."""
    timeouts: list[float] = []

    def run(argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        timeouts.append(timeout)
        if outcome == "hangs":
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, 0, TOOLS.get(" ".join(["nvidia-smi", *argv[1:]]), ""), "")

    monkeypatch.setattr(devices.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(devices.subprocess, "run", run)
    return timeouts


def test_without_pynvml_nvidia_smi_gets_time_to_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an 8-GPU node without persistence mode nvidia-smi takes seconds: the fallback waits 30 s, not 2."""
    absent(monkeypatch, "pynvml")
    timeouts = fake_run(monkeypatch, "answers")
    assert devices.smi_facts(False) == ("535.104.05", "vbios 92.00.45.00.06", ("Enabled", "Disabled"))
    assert timeouts == [devices.SMI_TIMEOUT_S] and devices.SMI_TIMEOUT_S >= 30


def test_a_tool_that_hung_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wedged driver costs one timeout per process, not one per query (the MIG retry, the identity, the topology)."""
    absent(monkeypatch, "pynvml")
    timeouts = fake_run(monkeypatch, "hangs")
    assert devices.smi_facts(False) == (None, None, ())
    assert identity.smi_devices(False) == () and identity.nvidia_topology() == ()
    assert timeouts == [devices.SMI_TIMEOUT_S]


@pytest.mark.parametrize("is_rocm", [False, True])
def test_a_rank_finds_its_gpu_in_the_tools_list(monkeypatch: pytest.MonkeyPatch, is_rocm: bool) -> None:
    """identity.probe on a GPU rank: torch's UUID finds the tool's row (the first GPU); a device torch gives no
    UUID for is found by its PCI bus id (the second); the row adds the serial, the tool's index and the VBIOS."""
    tools(monkeypatch)
    absent(monkeypatch, "pynvml", "amdsmi")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    first = ("28ff74a1-0000-1000-803c-3b7a6ea8fd0d" if is_rocm else "5e2b1a8c-1111-2222-3333-444455556666")
    props = [SimpleNamespace(name="GPU 0", uuid=first),
             SimpleNamespace(name="GPU 1", uuid=None, pci_domain_id=0, pci_bus_id=0x22 if is_rocm else 0x2A,
                             pci_device_id=0)]
    torch = SimpleNamespace(version=SimpleNamespace(hip="6.4" if is_rocm else None),
                            cuda=SimpleNamespace(get_device_properties=lambda index: props[index]))
    zero, one = identity.probe(4, 0, "cuda", torch), identity.probe(5, 1, "cuda", torch)
    assert (zero["rank"], zero["device"], zero["model"], zero["smi_index"], zero["found_by"]) == (4, "cuda:0", "GPU 0",
                                                                                                   0, "uuid")
    assert (one["smi_index"], one["found_by"], one["uuid"]) == (1, "pci bus id", identity.smi_devices(is_rocm)[1].uuid)
    if is_rocm:
        assert (zero["bus_id"], zero["serial"], one["serial"], zero["firmware"]) == (
            "0000:0c:00.0", "0x9D4C2F1A0B3E5D71", None, None)
    else:
        assert (zero["bus_id"], zero["serial"], one["serial"], zero["firmware"]) == (
            "0000:18:00.0", "1652823045678", None, "vbios 92.00.45.00.06")
        assert zero["uuid"] == "GPU-5e2b1a8c-1111-2222-3333-444455556666"  # the tool's form
