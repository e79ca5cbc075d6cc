"""The vendor's management library read in this process: NVML through ``pynvml``, AMD SMI through ``amdsmi``.

Preferred to the tools (no new process; ``nvidia-smi`` can take seconds without persistence mode); neither is a
dependency. Values are the tools' own words, so a fingerprint is the same whichever path read it; each library
is read once per process, a missing value is None. Never raises (callers then run the tools).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

# Every --query-gpu field a probe asks for, and how NVML answers it (handle -> the tool's text).
_NVML_FIELDS: dict[str, Callable[[Any, Any], object]] = {
    "index": lambda nvml, h: nvml.nvmlDeviceGetIndex(h),
    "name": lambda nvml, h: nvml.nvmlDeviceGetName(h),
    "uuid": lambda nvml, h: nvml.nvmlDeviceGetUUID(h),
    "serial": lambda nvml, h: nvml.nvmlDeviceGetSerial(h),
    "pci.bus_id": lambda nvml, h: nvml.nvmlDeviceGetPciInfo(h).busId,  # "00000000:18:00.0", as nvidia-smi prints
    "vbios_version": lambda nvml, h: nvml.nvmlDeviceGetVbiosVersion(h),
    "mig.mode.current": lambda nvml, h: ("Disabled", "Enabled")[int(nvml.nvmlDeviceGetMigMode(h)[0])],
}


def _text(value: object) -> str | None:
    """A library's answer as the tool's text: old pynvml releases return bytes."""
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


T = TypeVar("T")


def _read(fn: Callable[[], object]) -> str | None:
    try:
        return _text(fn())
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported, an older binding without the call: the tool's N/A
        return None


def _import(name: str) -> Any:
    """The binding module, or None where it is not installed (or fails to load its library on import)."""
    try:
        with warnings.catch_warnings():  # the deprecated "pynvml" package warns on import
            warnings.simplefilter("ignore")
            return __import__(name)
    except Exception:  # noqa: BLE001 - ImportError, or OSError from a binding that loads its library at import
        return None


def _through(name: str, init: str, shutdown: str, read: Callable[[Any], T]) -> T | None:
    """``read(library)`` between the binding's init and shutdown calls; None without the binding, where its library
    does not start (no driver library, no GPU, amdgpu not loaded, no permission: the tool says what it can) or
    where it fails half-way (the tool is asked instead)."""
    library = _import(name)
    if library is None:
        return None
    try:
        getattr(library, init)()
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    try:
        return read(library)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    finally:
        _read(getattr(library, shutdown))


def _nvml_rows(nvml: Any) -> tuple[dict[str, str | None], ...]:
    driver = _read(nvml.nvmlSystemGetDriverVersion)
    rows = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        row = {name: _read(functools.partial(get, nvml, handle)) for name, get in _NVML_FIELDS.items()}
        rows.append({**row, "driver_version": driver})
    return tuple(rows)


@functools.lru_cache(maxsize=1)
def _nvml_devices() -> tuple[dict[str, str | None], ...] | None:
    """Every GPU NVML lists, with every field of _NVML_FIELDS and "driver_version"; None without NVML."""
    return _through("pynvml", "nvmlInit", "nvmlShutdown", _nvml_rows)


def nvidia_rows(fields: Sequence[str]) -> list[dict[str, str | None]] | None:
    """What ``nvidia-smi --query-gpu=<fields> --format=csv,noheader`` gives through parse_nvidia_smi, read through
    NVML: one dict per GPU with exactly ``fields`` (a field NVML cannot give is None). None without NVML."""
    devices = _nvml_devices()
    if devices is None:
        return None
    return [{name: row.get(name) for name in fields} for row in devices]


@dataclass(frozen=True)
class SmiDevice:
    """One GPU as the vendor's tool lists it (device_identity normalizes the bus id and UUID)."""

    index: int
    bus_id: str | None = None
    uuid: str | None = None
    serial: str | None = None  # AMD: "0x<16 hex digits>", amdsmi's own formatting
    name: str | None = None
    firmware: str | None = None  # NVIDIA: the VBIOS, per GPU (a node may mix them after a partial flash)


@dataclass(frozen=True)
class AmdFacts:
    """``amd-smi version``'s amdgpu version, ``amd-smi firmware -g 0``'s firmware, ``amd-smi list``'s GPUs."""

    driver: str | None
    firmware: dict[str, str] = field(default_factory=dict)  # fw id -> version, in listed order
    devices: tuple[SmiDevice, ...] = ()


def _firmware(amdsmi: Any, handle: Any) -> dict[str, str]:
    """As ``amd-smi firmware --json`` names it: the block's enum name without its prefix ("CP_MEC1")."""
    out: dict[str, str] = {}
    for entry in amdsmi.amdsmi_get_fw_info(handle).get("fw_list", []):
        block = entry.get("fw_name", entry.get("fw_id"))
        name = _text(getattr(block, "name", block)) or ""
        name = name.removeprefix("AMDSMI_FW_ID_").removeprefix("FW_ID_")  # amd-smi's own renaming, old and new
        version = _text(entry.get("fw_version"))
        if name and version:
            out[name] = version
    return out


def _amd_facts(amdsmi: Any) -> AmdFacts:
    handles = list(amdsmi.amdsmi_get_processor_handles())
    devices = tuple(SmiDevice(i, _read(functools.partial(amdsmi.amdsmi_get_gpu_device_bdf, h)),
                              _read(functools.partial(amdsmi.amdsmi_get_gpu_device_uuid, h)),
                              _read(lambda h=h: amdsmi.amdsmi_get_gpu_asic_info(h)["asic_serial"]))
                    for i, h in enumerate(handles))  # amd-smi's GPU index is the handle's position
    if not handles:
        return AmdFacts(None)
    driver = _read(lambda: amdsmi.amdsmi_get_gpu_driver_info(handles[0])["driver_version"])
    try:
        firmware = _firmware(amdsmi, handles[0])
    except Exception:  # noqa: BLE001 - no firmware list: amd-smi prints N/A
        firmware = {}
    return AmdFacts(driver, firmware, devices)


@functools.lru_cache(maxsize=1)
def amd_facts() -> AmdFacts | None:
    """The AMD SMI library's view of this node's GPUs; None without it."""
    return _through("amdsmi", "amdsmi_init", "amdsmi_shut_down", _amd_facts)


def forget() -> None:
    """Read the libraries again at the next probe (tests, and a process that swapped its binding)."""
    _nvml_devices.cache_clear()
    amd_facts.cache_clear()
