"""Device facts beyond torch's own: DNN and BLAS library, MIG, driver and firmware versions.

Parsers are pure (tests feed recorded output); probes prefer the vendor's library (smi_bindings.py), else run
the SMI tool, and give None for what they cannot read: a missing or hung tool never fails a session.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from . import smi_bindings
from .fingerprint_fields import PROBED_FIELDS

# Without persistence mode the tools initialise every GPU (seconds on an 8-GPU node): a generous limit, asked once
# per process; a tool that hangs is not asked again (_HUNG).
SMI_TIMEOUT_S = 30.0
# One nvidia-smi call for all three; a driver that predates MIG rejects the whole query (see _smi).
NVIDIA_QUERY = ("driver_version", "vbios_version", "mig.mode.current")
# Fields probe_device() adds to the fingerprint's device section (driver exists already): declared probed there.
DEVICE_FIELDS = PROBED_FIELDS

_NOT_A_VALUE = {"", "n/a", "[n/a]", "not supported", "[not supported]", "unknown", "[unknown error]"}
# A TORCH_BLAS_PREFER_*LT value as torch reads it: true prefers the Lt library, false the classic one.
_PREFER_LT = {**dict.fromkeys(("1", "true", "on", "yes", "y"), "cublaslt"),
              **dict.fromkeys(("0", "false", "off", "no", "n"), "cublas")}
# torch's BLAS backend names (torch._C._BlasBackend and the strings preferred_blas_library takes)
# -> the library doing the work, on CUDA and on ROCm (where "Cublas" goes through hipBLAS to rocBLAS).
_BLAS_NAMES = {**dict.fromkeys(("cublas", "hipblas"), ("cuBLAS", "rocBLAS")),
               **dict.fromkeys(("cublaslt", "hipblaslt"), ("cuBLASLt", "hipBLASLt")),
               "ck": ("CK", "CK"), "default": ("default", "default")}


def _value(text: object) -> str | None:
    """A reported value, or None for the placeholders the tools print instead of one."""
    if text is None:
        return None
    cleaned = str(text).strip()
    return None if cleaned.lower() in _NOT_A_VALUE else cleaned



def parse_nvidia_smi(text: str, fields: Sequence[str] = NVIDIA_QUERY) -> list[dict[str, str | None]]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader``, one dict per GPU: ``[N/A]`` and
    ``[Not Supported]`` become None; lines without one cell per field (warnings) are skipped."""
    rows: list[dict[str, str | None]] = []
    for line in text.splitlines():
        cells = line.split(",")
        if line.strip() and len(cells) == len(fields):
            rows.append({field: _value(cell) for field, cell in zip(fields, cells)})
    return rows


def parse_amd_smi_version(text: str) -> dict[str, str]:
    """``amd-smi version`` (text or ``--json``) as {"amdsmi", "amdsmi_library", "rocm", "amdgpu", ...}.

    Text form: ``AMDSMI Tool: 26.1.0+cd50d9e0 | AMDSMI Library version: 26.1.0 | ROCm version: 7.10.0 |
    amdgpu version: 6.16.6 | amd_hsmp version: N/A``. Values reading N/A are left out.
    """
    out: dict[str, str] = {}
    for label, raw in _amd_smi_version_pairs(text):
        key = "_".join(label.strip().lower().replace("-", " ").split())
        key = {"version": "amdsmi", "amdsmi_tool": "amdsmi"}.get(key, key.removesuffix("_version"))
        value = _value(raw)
        if key and value:
            out[key] = value
    return out


def _amd_smi_version_pairs(text: str) -> list[tuple[str, object]]:
    """(label, value) in ``amd-smi version``: the JSON object's keys but "tool", else the text's ``label: value``."""
    data = _json_payload(text)
    if isinstance(data, list):
        data = data[0] if data and isinstance(data[0], dict) else None
    if isinstance(data, dict):
        return [(str(k), v) for k, v in data.items() if k != "tool"]
    version_line = "\n".join(line for line in text.splitlines() if "|" in line)  # amd-smi may print others around it
    return re.findall(r"([^|:\n]+):([^|\n]*)", version_line)


def parse_amd_smi_firmware(json_text: str) -> dict[str, str]:
    """The first GPU's firmware from ``amd-smi firmware --json``, as {fw_id: version} in listed order. Accepts each
    release's shape: a list of {"gpu", "fw_list"}, a {"gpu_data": [...]} wrapper or one GPU's dict; entries as
    {"fw_id"|"fw_name", "fw_version"} or wrapped as {"FW 0": {...}}."""
    data = _json_payload(json_text)
    if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
        data = data["gpu_data"]
    for gpu in data if isinstance(data, list) else [data]:
        found = _fw_versions(gpu.get("fw_list")) if isinstance(gpu, dict) else {}
        if found:
            return found
    return {}


def _fw_versions(fw_list: object) -> dict[str, str]:
    """One GPU's ``fw_list`` as {fw_id: version}: the entries that give both."""
    out: dict[str, str] = {}
    for entry in fw_list if isinstance(fw_list, list) else []:
        if isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict):
            entry = next(iter(entry.values()))  # the {"FW 0": {...}} wrapping
        if not isinstance(entry, dict):
            continue
        name = _value(entry.get("fw_id", entry.get("fw_name", entry.get("name"))))
        version = _value(entry.get("fw_version", entry.get("version")))
        if name and version:
            out[name] = version
    return out


def firmware_summary(firmware: Mapping[str, str]) -> str | None:
    """``CP_MEC1 32945, RLC 65, ...``: one string, so a change shows as one field in a fingerprint diff."""
    return ", ".join(f"{name} {version}" for name, version in firmware.items()) or None


def dnn_version(value: object, is_rocm: bool) -> str | None:
    """``torch.backends.cudnn.version()`` as ``cuDNN 9.1.0`` or, on ROCm builds, ``MIOpen 3.2.0``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    if is_rocm:
        # torch encodes MIOpen as MAJOR*1000000 + MINOR*1000 + PATCH (torch/csrc/cuda/shared/cudnn.cpp).
        # MIOpen's major is >= 2, so a smaller number is read as MAJOR*10000 + MINOR*100 + PATCH.
        if value >= 1_000_000:
            return f"MIOpen {value // 1_000_000}.{value // 1000 % 1000}.{value % 1000}"
        return f"MIOpen {value // 10000}.{value // 100 % 100}.{value % 100}"
    # CUDNN_VERSION is MAJOR*10000 + MINOR*100 + PATCH from cuDNN 9 on, MAJOR*1000 + MINOR*100 + PATCH before.
    if value >= 90000:
        return f"cuDNN {value // 10000}.{value // 100 % 100}.{value % 100}"
    return f"cuDNN {value // 1000}.{value // 100 % 10}.{value % 100}"


def blas_library(preferred: object, is_rocm: bool, env: Mapping[str, str] | None = None) -> str | None:
    """The library GPU matmuls go to (cuBLAS / cuBLASLt, rocBLAS / hipBLASLt / CK): torch's ``preferred``
    library, else the TORCH_BLAS_PREFER_* variables (torch's initial choice); None when neither says."""
    name = getattr(preferred, "name", preferred)
    if isinstance(name, str) and name.lower() in _BLAS_NAMES:
        return _BLAS_NAMES[name.lower()][is_rocm]
    env = os.environ if env is None else env
    for var in ("TORCH_BLAS_PREFER_HIPBLASLT", "TORCH_BLAS_PREFER_CUBLASLT"):
        choice = _PREFER_LT.get(env.get(var, "").strip().lower())
        if choice:
            return _BLAS_NAMES[choice][is_rocm]
    return None


def mig_state(modes: Sequence[str | None], visible_devices: str | None) -> str | None:
    """``enabled, instance MIG-...`` / ``enabled`` / ``disabled`` from the per-GPU ``mig.mode.current`` ``modes`` and
    the ``MIG-`` entries of CUDA_VISIBLE_DEVICES (``MIG-<uuid>``, ``MIG-GPU-<uuid>/<gi>/<ci>``); None without MIG."""
    instances = [d.strip() for d in (visible_devices or "").split(",") if d.strip().startswith("MIG-")]
    states = sorted({m.strip().lower() for m in modes if _value(m)})
    if not states and not instances:
        return None
    state = "/".join(states) or "enabled"  # a MIG instance visible means MIG is on, whatever the query said
    return f"{state}, instance {','.join(instances)}" if instances else state


def _json_payload(text: str) -> Any:
    """The JSON document in a tool's output, skipping banner lines printed before it; None if there is none."""
    lines = text.splitlines(keepends=True)
    for n, line in enumerate(lines):
        if line.lstrip().startswith(("[", "{")):
            try:
                return json.JSONDecoder().raw_decode("".join(lines[n:]).lstrip())[0]
            except ValueError:
                continue
    return None



# Tools that ran past their timeout in this process (a wedged driver): each is waited for once, not once per query.
_HUNG: set[str] = set()


def run_tool(argv: Sequence[str], timeout: float = SMI_TIMEOUT_S) -> str | None:
    """A tool's stdout, or None when it is not installed, fails, takes longer than ``timeout``, or did so before."""
    exe = shutil.which(argv[0])
    if exe is None or exe in _HUNG:
        return None
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, errors="replace",
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        _HUNG.add(exe)
        return None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout if done.returncode == 0 else None


def nvidia_query(fields: Sequence[str]) -> list[dict[str, str | None]] | None:
    """parse_nvidia_smi's rows of ``nvidia-smi --query-gpu=<fields>``: read through NVML where pynvml is installed
    (a field it cannot give is None, as the tool's [N/A]), else from the tool; None when the tool failed or
    rejected a field."""
    bound = smi_bindings.nvidia_rows(fields)
    if bound is not None:
        return [{name: _value(text) for name, text in row.items()} for row in bound]
    text = run_tool(("nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"))
    return None if text is None else parse_nvidia_smi(text, fields)


@functools.lru_cache(maxsize=2)
def smi_facts(is_rocm: bool) -> tuple[str | None, str | None, tuple[str | None, ...]]:
    """(driver, firmware, per-GPU MIG modes) from the vendor's library or SMI tool, in the tool's words; cached:
    none can change while the process holds the GPU."""
    return _amd_smi_facts() if is_rocm else _nvidia_smi_facts()


def _amd_smi_facts() -> tuple[str | None, str | None, tuple[str | None, ...]]:
    facts = smi_bindings.amd_facts()
    if facts is not None:
        return _value(facts.driver), firmware_summary({k: v for k, v in facts.firmware.items() if _value(v)}), ()
    version = parse_amd_smi_version(run_tool(("amd-smi", "version")) or "")
    firmware = parse_amd_smi_firmware(run_tool(("amd-smi", "firmware", "-g", "0", "--json")) or "")
    return version.get("amdgpu"), firmware_summary(firmware), ()


def _nvidia_smi_facts() -> tuple[str | None, str | None, tuple[str | None, ...]]:
    rows = nvidia_query(NVIDIA_QUERY)
    if rows is None:  # a driver without MIG support rejects the field; ask again without it
        rows = nvidia_query(NVIDIA_QUERY[:2]) or []
    first = rows[0] if rows else {}
    vbios = first.get("vbios_version")
    return first.get("driver_version"), f"vbios {vbios}" if vbios else None, tuple(r.get("mig.mode.current") for r in rows)


def probe_device(torch: Any) -> dict[str, Any]:
    """DEVICE_FIELDS plus ``driver`` for a CUDA or ROCm device. Never raises: a fact that cannot be read is None."""
    is_rocm = bool(getattr(torch.version, "hip", None))
    driver, firmware, modes = _quietly(smi_facts, is_rocm) or (None, None, ())
    return {
        "dnn": dnn_version(_quietly(lambda: torch.backends.cudnn.version()), is_rocm),
        "blas_library": blas_library(_quietly(lambda: torch.backends.cuda.preferred_blas_library()), is_rocm),
        "mig": None if is_rocm else mig_state(modes, os.environ.get("CUDA_VISIBLE_DEVICES")),
        "driver": driver,
        "firmware": firmware,
    }


def _quietly(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a fact we cannot read is recorded as None, never a failed session
        return None
