"""Which devices may be expected to compute the same bits: the same device model and the same stack.

The key is the part of the fingerprint that changes what one device computes alone. Left out on purpose:
collectives (the workload runs none), host names, device count, and firmware (it computes none of a step's
numbers and differs between nodes; report.py shows it beside a dissenter). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "device": ("kind", "name", "arch", "cuda", "hip", "driver", "dnn", "blas_library", "cpu_model", "cpu_capability"),
    "versions": ("torch", "numpy"),
    "numerics": ("blas", "tf32_matmul", "tf32_cudnn", "float32_matmul_precision", "bf16_reduced_precision_reduction",
                 "fp16_reduced_precision_reduction", "deterministic_algorithms", "cudnn_deterministic",
                 "cublas_workspace_config", "num_threads"),
}
# Environment that only routes or tunes collectives: it cannot change what one device computes alone.
_COLLECTIVE_ENV = ("NCCL_", "RCCL_", "GLOO_", "TORCH_NCCL_")


def group_key(fingerprint: dict[str, Any], model: str | None, arch: str | None = None) -> dict[str, Any]:
    """The flat key (``section.field`` -> value) of one device. ``model``/``arch``: this device's own, since the
    fingerprint's device section describes device 0 of the machine."""
    key = {f"{section}.{name}": (fingerprint.get(section) or {}).get(name)
           for section, names in KEY_FIELDS.items() for name in names}
    if model is not None:
        key["device.name"] = model
    if arch is not None:
        key["device.arch"] = arch
    env = (fingerprint.get("comm") or {}).get("env") or {}
    key.update({f"env.{k}": v for k, v in sorted(env.items()) if not k.startswith(_COLLECTIVE_ENV)})
    return key


def key_id(key: dict[str, Any]) -> str:
    """A short stable id of a key, to group by."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]


def key_diff(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Fields whose values differ, as (field, base's, other's)."""
    return [(k, base.get(k), other.get(k)) for k in sorted(set(base) | set(other)) if base.get(k) != other.get(k)]


def describe_key(key: dict[str, Any]) -> str:
    """One line naming a group: its device model and the stack that computes on it."""
    kind = key.get("device.kind")
    if kind == "cuda":
        runtime = f"HIP {key['device.hip']}" if key.get("device.hip") else f"CUDA {key.get('device.cuda')}"
        return f"{key.get('device.name')} ({key.get('device.arch')}), {runtime}, driver {key.get('device.driver')}, " \
               f"torch {key.get('versions.torch')}"
    return f"cpu {key.get('device.cpu_model')} [{key.get('device.cpu_capability')}], torch {key.get('versions.torch')}"
