"""The stack fingerprint: everything that can change the numbers a training step computes.

``collect()`` imports torch and reads versions, devices, BLAS and kernel switches and the
collective-library environment. ``diff()`` and ``numerics_key()`` work on plain dicts, so the
comparison side never needs torch. A fingerprint is a two-level dict: section -> field -> value.
"""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata
from typing import Any

from . import fingerprint_fields as schema
from .devices import probe_device

Fingerprint = dict[str, dict[str, Any]]

# Which fields decide the exact lane, which are hardware or an upgrade: declared once, in fingerprint_fields.py.
NUMERICS_FIELDS = schema.NUMERICS_FIELDS


def canonical(name: str) -> str:
    """A distribution's normalized name (PEP 503): "Flash_Attn" -> "flash-attn"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_packages() -> dict[str, str]:
    """Every installed distribution, by normalized name, with its version, marked "(editable)" or "(local)" where
    it was installed from a folder or a file (pip's direct_url.json) rather than from an index: those cannot be
    fetched again by version (a bisect cannot overlay them). The first of a name on the path, as imports find it."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        found.setdefault(canonical(name), f"{dist.version}{_install_kind(dist)}")
    return dict(sorted(found.items()))


def _install_kind(dist: metadata.Distribution) -> str:
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except (ValueError, OSError):
        return ""
    if (direct.get("dir_info") or {}).get("editable"):
        return " (editable)"
    if direct.get("vcs_info"):
        return " (vcs)"
    return " (local)" if str(direct.get("url", "")).startswith("file:") else ""


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, or None where it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo; None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(field)), None)
    except OSError:
        return None


def _cpu_model() -> str:
    model = _cpuinfo("model name")
    if model is None:  # not Linux
        return platform.processor() or platform.machine()
    return model


def cpu_bf16() -> str:
    """The bf16 instructions oneDNN may use for a CPU's bf16 matmuls ("amx_bf16", "avx512_bf16" or "none"). oneDNN
    picks its ISA itself: ATEN_CPU_CAPABILITY does not reach it, so a bf16 run computes other bits on a CPU with
    other bf16 instructions even where cpu_capability reads the same. ONEDNN_MAX_CPU_ISA caps it (named with it)."""
    flags = (_cpuinfo("flags") or "").split()
    found = next((isa for isa in ("amx_bf16", "avx512_bf16") if isa in flags), "none")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return f"{found} (max ISA {cap})" if cap and found != "none" else found


def _blas_info(torch: Any) -> str:
    text = torch.__config__.show()
    found = re.search(r"BLAS_INFO=(\w+)", text)
    blas = found.group(1) if found else "unknown"
    mkl = re.search(r"Intel\(R\) (?:oneAPI )?Math Kernel Library Version ([\d.]+)", text)
    return f"{blas} {mkl.group(1)}" if mkl else blas


def _sdpa_backends(torch: Any) -> dict[str, bool]:
    cuda = torch.backends.cuda  # a torch without a backend's switch has no such backend
    return {name: bool(getattr(cuda, f"{name}_sdp_enabled")()) for name in ("flash", "mem_efficient", "math", "cudnn")
            if hasattr(cuda, f"{name}_sdp_enabled")}


def _device_section(torch: Any, device_kind: str) -> dict[str, Any]:
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    section: dict[str, Any] = {
        "kind": device_kind,
        "cpu_model": _cpu_model(),
        "cpu_capability": cpu_capability,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    if device_kind == "cuda" and torch.cuda.is_available():
        from .platforms import gpu_arch

        probed = probe_device(torch)
        section.update(
            name=torch.cuda.get_device_name(0),
            count=torch.cuda.device_count(),
            arch=gpu_arch(torch),
            cuda=torch.version.cuda,
            hip=getattr(torch.version, "hip", None),
            driver=probed.pop("driver") or _driver_version(torch),  # the SMI tool's value where it answers
            **probed,
        )
    else:
        # count: accelerators only; the GPU fields are None, as in references recorded before they existed
        section.update(name="cpu", count=None, arch=platform.machine(), **dict.fromkeys(schema.PROBED_FIELDS))
    return section


def _driver_version(torch: Any) -> str | None:
    return _read_first("/sys/module/amdgpu/version" if getattr(torch.version, "hip", None) else
                       "/proc/driver/nvidia/version")


def _read_first(path: str) -> str | None:
    """The version number on a file's first line (the whole line where it has none); None without the file."""
    try:
        with open(path) as fh:
            line = fh.readline().strip()
    except OSError:
        return None
    found = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
    return found.group(1) if found else line or None


def _nccl_version(torch: Any) -> str | None:
    try:
        if not torch.cuda.is_available():
            return None
        version = torch.cuda.nccl.version()
        return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    except Exception:  # noqa: BLE001 - a build without NCCL simply has none
        return None


def collect(
    device_kind: str = "cpu",
    backend: str | None = None,
    world_size: int | None = None,
    determinism: dict[str, Any] | None = None,
    bf16: bool = False,
) -> Fingerprint:
    """Read the fingerprint of this process's stack. Imports torch. ``bf16``: the run computes in bf16, so on a
    CPU the bf16 instructions oneDNN may use are part of it (``device.cpu_bf16``; fp32 runs leave it out, and so
    keep their lane against references recorded before it was read)."""
    import torch

    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            **{dist: installed_version(dist) for dist in ("transformers", "peft", "accelerate", "safetensors", "numpy")},
            "pytest_gpuregress": installed_version("pytest-gpuregress"),
        },
        "device": {**_device_section(torch, device_kind),
                   **({"cpu_bf16": cpu_bf16()} if bf16 and device_kind == "cpu" else {})},
        "numerics": _numerics_section(torch, determinism or {}),
        "comm": {
            "backend": backend,
            "world_size": world_size,
            "nccl_version": _nccl_version(torch),
            "rccl": bool(getattr(torch.version, "hip", None)),
            "env": {k: v for k, v in sorted(os.environ.items()) if schema.recorded_env(k)},
        },
        "packages": installed_packages(),
    }


def _numerics_section(torch: Any, determinism: dict[str, Any]) -> dict[str, Any]:
    """The process-wide switches that pick kernels and precision, and what set_determinism set."""
    matmul = torch.backends.cuda.matmul
    return {
        "blas": _blas_info(torch),
        "sdpa_backends": _sdpa_backends(torch),
        "tf32_matmul": bool(getattr(matmul, "allow_tf32", False)),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": bool(getattr(matmul, "allow_bf16_reduced_precision_reduction", False)),
        "fp16_reduced_precision_reduction": bool(getattr(matmul, "allow_fp16_reduced_precision_reduction", False)),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "num_threads": torch.get_num_threads(),
        **{f"determinism.{k}": v for k, v in determinism.items()},
    }


def diff(reference: Fingerprint, current: Fingerprint) -> list[tuple[str, Any, Any]]:
    """Fields that differ, as (section.field, reference value, current value). A package the versions section names
    (torch, transformers...) is said there once, not again among the packages."""
    named = {f"packages.{canonical(k)}" for k in reference.get("versions") or {}}
    out: list[tuple[str, Any, Any]] = []
    for section in sorted(set(reference) | set(current)):
        out += _section_changes(section, reference.get(section, {}), current.get(section, {}))
    return [change for change in out if change[0] not in named]


def _section_changes(section: str, ref: Any, cur: Any) -> list[tuple[str, Any, Any]]:
    """One section's fields that differ, as (section.field, reference value, current value)."""
    if section == "packages":  # None in a fingerprint recorded before the packages were read
        ref, cur = ref or {}, cur or {}
    if not (isinstance(ref, dict) and isinstance(cur, dict)):
        return [] if ref == cur else [(section, ref, cur)]
    return [(f"{section}.{k}", ref.get(k), cur.get(k)) for k in sorted(set(ref) | set(cur)) if ref.get(k) != cur.get(k)]


def describe_change(name: str, old: Any, new: Any) -> str:
    """One change for a report: ``transformers 5.24.0 -> 5.23.0``, ``device.cpu_capability: AVX2 -> AVX512``,
    ``kernels 0.19.1 added (can change computation)``."""
    if name.startswith("versions."):
        return f"{name.split('.', 1)[1]} {old} -> {new}"
    if name.startswith("packages."):
        package = name.split(".", 1)[1]
        what = f"{package} {new} added" if old is None else f"{package} {old} removed" if new is None else \
            f"{package} {old} -> {new}"
        return what + (" (can change computation)" if schema.computes(package) else "")
    return f"{name}: {_short(old)} -> {_short(new)}"


def summarize_changes(changes: list[tuple[str, Any, Any]], others_shown: int = 3) -> str:
    """One line for the closing table: every software change first (library versions, runtime, driver, cuDNN, BLAS,
    NCCL), never dropped, then at most ``others_shown`` of the rest (hardware, switches) and a count of what is left
    out. The whole list is in the failure report and in the JUnit property ``stack_changes``."""
    software = sorted((c for c in changes if _software_rank(c[0]) is not None), key=lambda c: _software_rank(c[0]))
    others = [c for c in changes if _software_rank(c[0]) is None]
    text = ", ".join(describe_change(*c) for c in software + others[:others_shown])
    hidden = len(others) - others_shown
    return text + (f", and {hidden} more (all in the failure report and JUnit's stack_changes)" if hidden > 0 else "")


def _software_rank(name: str) -> int | None:
    """Where a change stands among the software changes: library versions, then packages that compute, then the
    runtime, driver and libraries of the device and collectives; None for the rest."""
    section, _, rest = name.partition(".")
    if section == "versions":
        return 0
    if section == "packages":
        return 1 if schema.computes(rest) else None
    return 2 if name in schema.SOFTWARE_KEYS else None


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Hardware fields (fingerprint_fields.py): timings, memory and bandwidth are comparable only between runs on the
# same. The CPU capability is one: one "AMD EPYC" model string covers AVX2 and AVX512 generations, and a kernel
# path forced lower (ATEN_CPU_CAPABILITY) changes speed by itself.
FORCED_CPU_PATH = "ATEN_CPU_CAPABILITY"
# On GPUs the host CPU's fields do not count: two hosts of the same GPUs with other CPUs time the same GPU work.
GPU_HARDWARE_FIELDS = tuple(k for k in schema.HARDWARE_FIELDS if not k.startswith("cpu_"))


def hardware_diff(reference: Fingerprint, current: Fingerprint) -> list[tuple[str, Any, Any]]:
    """The hardware fields that differ (only those the reference recorded; on GPUs, GPU_HARDWARE_FIELDS)."""
    ref, cur = reference.get("device") or {}, current.get("device") or {}
    on_gpu = ref.get("kind") not in (None, "cpu") and ref.get("kind") == cur.get("kind")
    fields = GPU_HARDWARE_FIELDS if on_gpu else schema.HARDWARE_FIELDS
    out = [(f"device.{k}", ref.get(k), cur.get(k)) for k in fields if k in ref and ref.get(k) != cur.get(k)]
    return out if on_gpu else out + _forced_cpu_path_change(reference, current)


def _forced_cpu_path_change(reference: Fingerprint, current: Fingerprint) -> list[tuple[str, Any, Any]]:
    """A forced CPU kernel path hides the CPU's own (one "AMD EPYC" with AVX512 forced to AVX2 reads like the AVX2
    machine that recorded): timings under another forcing than the reference's are not of the same hardware path."""
    key = f"comm.env.{FORCED_CPU_PATH}"
    forced = (lookup(reference, key), lookup(current, key))
    return [(key, *forced)] if forced[0] != forced[1] else []


def lookup(fp: Fingerprint, field: str) -> Any:
    """The fingerprint's value for ``section.field`` or ``comm.env.NAME``; None when not recorded."""
    section, _, name = field.partition(".")
    values = fp.get(section)
    if not isinstance(values, dict):
        return None
    if section == "comm" and name.startswith("env."):
        env = values.get("env")
        return env.get(name[4:]) if isinstance(env, dict) else None
    return values.get(name)


def numerics_key(fp: Fingerprint) -> dict[str, Any]:
    """The subset of a fingerprint whose equality means bitwise-equal results are expected."""
    key = {f"{section}.{name}": fp.get(section, {}).get(name) for section, names in NUMERICS_FIELDS.items()
           for name in names}
    key.update({f"numerics.{k}": v for k, v in fp.get("numerics", {}).items() if k.startswith("determinism.")})
    key.update({f"packages.{k}": v for k, v in (fp.get("packages") or {}).items() if schema.computes(k)})
    return key


def numerics_diff(reference: Fingerprint, current: Fingerprint) -> list[tuple[str, Any, Any]]:
    """Numerics fields that differ. A field the reference does not have at all was added to the fingerprint
    after it was recorded (device.dnn, device.blas_library): unknown then, so it cannot have changed. A package
    that computes counts once the reference recorded packages at all: one added since (kernels) is a change."""
    ref, cur = numerics_key(reference), numerics_key(current)
    keys = set(ref) | ({k for k in cur if k.startswith("packages.")} if isinstance(reference.get("packages"), dict)
                       else set())
    # cur.get: a determinism.* key the run lacks (a run set up without set_determinism) reads as None
    return [(k, ref.get(k), cur.get(k)) for k in sorted(keys)
            if ref.get(k) != cur.get(k) and (k.startswith("packages.") or _recorded(reference, k))]


def _recorded(fp: Fingerprint, key: str) -> bool:
    section, _, name = key.partition(".")
    return isinstance(fp.get(section), dict) and name in fp[section]


def header_lines(fp: Fingerprint) -> list[str]:
    """A few lines for the pytest report header."""
    v, n, c = fp["versions"], fp["numerics"], fp["comm"]
    env = " ".join(f"{k}={val}" for k, val in c.get("env", {}).items()) or "none"
    return [
        f"gpuregress stack: torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"accelerate {v['accelerate']}, safetensors {v['safetensors']}, python {v['python']}",
        f"gpuregress device: {_device_line(fp['device'])}; nccl {c.get('nccl_version') or '-'}",
        f"gpuregress numerics: blas {n['blas']}, tf32 {n['tf32_matmul']}, "
        f"deterministic {n['deterministic_algorithms']}, threads {n['num_threads']}; comm env: {env}",
        *_packages_line(fp.get("packages")),
    ]


def _device_line(d: dict[str, Any]) -> str:
    """The device, its runtime, and the fields a GPU run adds (shown only where recorded: a CPU run's header stays
    as it was)."""
    device = f"{d.get('name')} x{d.get('count')} ({d.get('arch')})" if d.get("kind") != "cpu" else (
        f"cpu {d.get('cpu_model')} [{d.get('cpu_capability')}]"
    )
    accel = [f"{k} {d[k]}" for k in ("cuda", "hip", "driver") if d.get(k)] or ["no accelerator runtime"]
    accel += [f"{label}{_short(d[k])}" for k, label in (("dnn", ""), ("blas_library", "blas "), ("mig", "MIG "),
                                                        ("firmware", "firmware ")) if d.get(k) is not None]
    return f"{device}; {', '.join(accel)}"


def _packages_line(packages: dict[str, str] | None) -> list[str]:
    """The header's line on the whole environment, where the fingerprint recorded it."""
    if packages is None:
        return []
    computing = ", ".join(f"{k} {val}" for k, val in packages.items() if schema.computes(k)) or "none"
    return [f"gpuregress packages: {len(packages)} installed; of those known to change computation: {computing}"]
