"""Which device a rank ran on, named the way an operator finds it again: node, local index, PCI bus id, UUID, serial.

Names a dissenting device (consensus) or a link (collective sweep). Parsers are pure, fed recorded tool output;
``probe`` matches the torch device to the tool's row by UUID, then PCI bus id, only then by index (CUDA's order
need not be the tool's), and a missing or failing tool gives None, never a failed run. Torch-free.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import smi_bindings
from .devices import _json_payload, _value, nvidia_query, parse_nvidia_smi, run_tool
from .smi_bindings import SmiDevice

NVIDIA_ID_QUERY = ("index", "pci.bus_id", "uuid", "serial", "name", "vbios_version")
# The environment variables that say which node a rank is on: torchrun's node rank, then Slurm's.
NODE_RANK_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi topo -m underlines its header, even into a pipe


def normal_bus_id(text: object) -> str | None:
    """A PCI address as ``dddd:bb:dd.f`` in lower case: nvidia-smi prints an 8-digit domain
    (``00000000:18:00.0``), amd-smi a 4-digit one (``0000:18:00.0``); None when it is not an address."""
    value = _value(text)
    found = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", value or "")
    if found is None:
        return None
    domain, bus, device, function = found.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def normal_uuid(text: object) -> str | None:
    """A device UUID without the tool's prefix (``GPU-``), lower case, so torch's and the tool's compare."""
    value = _value(text)
    if value is None:
        return None
    value = value.lower()
    return value[4:] if value.startswith("gpu-") else value



def parse_nvidia_ids(text: str) -> list[SmiDevice]:
    """``nvidia-smi --query-gpu=index,pci.bus_id,uuid,serial,name,vbios_version --format=csv,noheader``, a row a GPU."""
    return nvidia_ids(parse_nvidia_smi(text, NVIDIA_ID_QUERY))


def nvidia_ids(rows: list[dict[str, str | None]]) -> list[SmiDevice]:
    """The rows of NVIDIA_ID_QUERY (from nvidia-smi or NVML: devices.nvidia_query) as devices."""
    out = []
    for row in rows:
        index = row.get("index")
        if index is None or not index.isdigit():
            continue
        vbios = row.get("vbios_version")
        out.append(SmiDevice(int(index), normal_bus_id(row.get("pci.bus_id")), row.get("uuid"), row.get("serial"),
                             row.get("name"), f"vbios {vbios}" if vbios else None))
    return out


def parse_amd_list(text: str) -> list[SmiDevice]:
    """``amd-smi list --json`` (a list of {"gpu", "bdf", "uuid"}; older releases wrap or prefix the keys), or its
    text form (``GPU: 0`` then ``BDF:`` and ``UUID:`` lines)."""
    data = _json_payload(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", data.get("gpus", [data]))
    if not isinstance(data, list):
        return _parse_amd_list_text(text)
    return [SmiDevice(int(entry["gpu"]), normal_bus_id(entry.get("bdf", entry.get("gpu_bdf"))),
                      _value(entry.get("uuid", entry.get("gpu_uuid"))))
            for entry in data if isinstance(entry, dict) and str(entry.get("gpu", "")).isdigit()]


def _parse_amd_list_text(text: str) -> list[SmiDevice]:
    devices: list[dict[str, Any]] = []
    for line in text.splitlines():
        label, sep, raw = (part.strip() for part in line.partition(":"))
        label = label.upper()
        if label == "GPU" and raw.isdigit():  # raw is "" without a ":"
            devices.append({"index": int(raw)})
        elif sep and devices and label in _AMD_LIST_FIELDS:
            name, read = _AMD_LIST_FIELDS[label]
            devices[-1][name] = read(raw)
    return [SmiDevice(**d) for d in devices]


# The text form's lines under each "GPU: N" line: SmiDevice's field, read as the JSON form's value is.
_AMD_LIST_FIELDS = {"BDF": ("bus_id", normal_bus_id), "UUID": ("uuid", _value)}


def parse_amd_serials(text: str) -> dict[int, str]:
    """GPU index -> ASIC serial, from ``amd-smi static --asic --json`` (a list of {"gpu", "asic": {"asic_serial"}})."""
    data = _json_payload(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", [data])
    out: dict[int, str] = {}
    for entry in data if isinstance(data, list) else []:
        asic = entry.get("asic") if isinstance(entry, dict) else None
        serial = _value(asic.get("asic_serial")) if isinstance(asic, dict) else None
        if serial and str(entry.get("gpu", "")).isdigit():
            out[int(entry["gpu"])] = serial
    return out


def parse_nvidia_topology(text: str) -> dict[tuple[int, int], str]:
    """(GPU i, GPU j) -> the connection code of ``nvidia-smi topo -m`` (``NV18``, ``PIX``, ``SYS``, ...)."""
    columns: list[int] = []
    matrix: dict[tuple[int, int], str] = {}
    for raw in text.splitlines():
        cells = _ANSI.sub("", raw).split()
        if not columns:
            columns = [int(c[3:]) for c in cells if re.fullmatch(r"GPU\d+", c)]
            continue
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = int(cells[0][3:])
        for column, code in zip(columns, cells[1:]):
            if code != "X":
                matrix[(row, column)] = code
    return matrix


LINK_CODES = {
    "PIX": "PCIe through at most one PCIe switch",
    "PXB": "PCIe through several PCIe switches",
    "PHB": "PCIe through the CPU's host bridge",
    "NODE": "PCIe between host bridges of one NUMA node",
    "SYS": "PCIe and the inter-socket link (QPI/UPI/xGMI)",
}


def describe_link_code(code: str) -> str:
    """``NV18`` -> ``NVLink (18 links bonded, NV18)``; the PCIe codes as nvidia-smi's legend says."""
    bonded = re.fullmatch(r"NV(\d+)", code)
    if bonded:
        return f"NVLink ({bonded.group(1)} links bonded, {code})"
    return f"{LINK_CODES[code]} ({code})" if code in LINK_CODES else code


def match(devices: list[SmiDevice], uuid: str | None, bus_id: str | None,
          visible_index: int | None) -> tuple[SmiDevice | None, str]:
    """The tool's row for a torch device, and how it was found: by UUID, by PCI bus id, or by index (the tool's
    numbering can differ from CUDA's; said so, since then the row is a guess)."""
    keys: tuple[tuple[object, Callable[[SmiDevice], object], str], ...] = (
        (normal_uuid(uuid) or None, lambda device: normal_uuid(device.uuid), "uuid"),
        (normal_bus_id(bus_id), lambda device: device.bus_id, "pci bus id"),
        (visible_index, lambda device: device.index, "index (unverified: no UUID or bus id to match)"))
    for want, key, how in keys:
        found = next((device for device in devices if want is not None and key(device) == want), None)
        if found is not None:
            return found, how
    return None, "not found in the vendor tool's list"


def visible_index(local_rank: int, env: dict[str, str] | None = None) -> int | None:
    """The tool's index of CUDA device ``local_rank``: through CUDA_VISIBLE_DEVICES (or HIP's/ROCR's) when it lists
    indices, else the local rank itself; None when the list names devices by UUID."""
    env = dict(os.environ) if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES") or env.get("HIP_VISIBLE_DEVICES") or env.get("ROCR_VISIBLE_DEVICES")
    if not listed:
        return local_rank
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    if local_rank >= len(entries) or not entries[local_rank].isdigit():
        return None
    return int(entries[local_rank])


def node_rank(env: dict[str, str] | None = None) -> int:
    """This rank's node: torchrun's GROUP_RANK, else Slurm's SLURM_NODEID, else 0 (one machine)."""
    env = dict(os.environ) if env is None else env
    return next((int(env[name]) for name in NODE_RANK_VARIABLES if env.get(name, "").isdigit()), 0)



@functools.lru_cache(maxsize=2)
def smi_devices(is_rocm: bool) -> tuple[SmiDevice, ...]:
    """Every GPU the vendor's tool lists, once per process (none of it changes while the process runs)."""
    return _amd_devices() if is_rocm else tuple(nvidia_ids(nvidia_query(NVIDIA_ID_QUERY) or []))


def _amd_devices() -> tuple[SmiDevice, ...]:
    facts = smi_bindings.amd_facts()  # the AMD SMI library in process, where its binding is installed
    if facts is not None:
        return tuple(replace(d, bus_id=normal_bus_id(d.bus_id), uuid=_value(d.uuid), serial=_value(d.serial))
                     for d in facts.devices)
    listed = parse_amd_list(run_tool(("amd-smi", "list", "--json")) or "")
    serials = parse_amd_serials(run_tool(("amd-smi", "static", "--asic", "--json")) or "")
    return tuple(replace(d, serial=serials.get(d.index)) for d in listed)


@functools.lru_cache(maxsize=1)
def nvidia_topology() -> tuple[tuple[tuple[int, int], str], ...]:
    return tuple(parse_nvidia_topology(run_tool(("nvidia-smi", "topo", "-m")) or "").items())


def torch_bus_id(props: Any) -> str | None:
    """The PCI address torch reports for a device (newer releases have pci_domain_id/pci_bus_id/pci_device_id)."""
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(p, int) for p in parts):
        return None
    return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"


def probe(rank: int, local_rank: int, device_kind: str, torch: Any) -> dict[str, Any]:
    """This rank's identity: host, node, local index, device model, bus id, UUID, serial, the tool's index."""
    identity: dict[str, Any] = {"rank": rank, "host": socket.gethostname(), "node_rank": node_rank(),
                                "local_rank": local_rank, "device": "cpu", "model": None, "bus_id": None,
                                "uuid": None, "serial": None, "smi_index": None, "firmware": None, "found_by": "cpu"}
    if device_kind != "cuda":
        from .fingerprint import _cpu_model

        identity["model"] = _cpu_model()
        return identity
    return {**identity, **_gpu_identity(local_rank, torch)}


def _gpu_identity(local_rank: int, torch: Any) -> dict[str, Any]:
    """The GPU's model and, from the vendor tool's row for it, its bus id, UUID, serial, index and firmware."""
    is_rocm = bool(getattr(torch.version, "hip", None))
    props = torch.cuda.get_device_properties(local_rank)
    own_uuid = str(getattr(props, "uuid", "") or "") or None
    own_bus = torch_bus_id(props)
    row, found_by = match(list(smi_devices(is_rocm)), own_uuid, own_bus, visible_index(local_rank))
    row = row or SmiDevice(-1)
    return dict(device=f"cuda:{local_rank}", model=props.name, bus_id=row.bus_id or own_bus,
                uuid=row.uuid or own_uuid, serial=row.serial, smi_index=None if row.index < 0 else row.index,
                firmware=row.firmware, found_by=found_by)


def peer_links(identity: dict[str, Any]) -> dict[str, str]:
    """This GPU's connection to each other local GPU, by the tool's index (NVIDIA's topology matrix); {} elsewhere."""
    mine = identity.get("smi_index")
    if mine is None or identity.get("device") == "cpu":
        return {}
    return {str(j): code for (i, j), code in nvidia_topology() if i == mine}


def node_label(identity: dict[str, Any]) -> str:
    """``node 1 (host-b)``: the node rank tells apart nodes that share a host name (agents on one machine)."""
    return f"node {identity.get('node_rank', 0)} ({identity.get('host')})"
