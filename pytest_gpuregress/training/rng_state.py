"""Rank side: every random generator's state as JSON, and back, one file per rank.

Python's, numpy's, torch's CPU and this rank's device generator. ``restore`` is a fault point.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import numpy as np

from ..fault_points import fault_point

PIECES = ("python", "numpy", "torch_cpu", "torch_device")


def capture(device_kind: str) -> dict[str, Any]:
    """This rank's generator states, JSON-serialisable (torch's as hex strings of their bytes)."""
    import torch

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": {"version": version, "state": list(words), "gauss_next": gauss},
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch_cpu": bytes(torch.get_rng_state().numpy()).hex(),
    }
    if device_kind == "cuda":
        states["torch_device"] = bytes(torch.cuda.get_rng_state().numpy()).hex()
    return states


@fault_point("checkpoint.rng_restore")
def restore(states: dict[str, Any], device_kind: str) -> None:
    """Set every generator of this process from ``capture``'s output."""
    import torch

    py = states["python"]
    random.setstate((int(py["version"]), tuple(int(w) for w in py["state"]), py["gauss_next"]))
    nps = states["numpy"]
    np.random.set_state((nps["kind"], np.asarray(nps["keys"], dtype=np.uint32), int(nps["pos"]), int(nps["has_gauss"]),
                         float(nps["cached_gaussian"])))
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(states["torch_cpu"]), dtype=torch.uint8))
    if device_kind == "cuda" and "torch_device" in states:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(states["torch_device"]), dtype=torch.uint8))


def scramble(seed: int, device_kind: str) -> None:
    """Seed every generator with values no run uses, before a load: a generator the load forgets then
    cannot match the saved state by chance (a reused worker process would otherwise carry it over)."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device_kind == "cuda":
        torch.cuda.manual_seed(seed)


def digests(states: dict[str, Any]) -> dict[str, str]:
    """sha256 per generator: "rng.python" and so on."""
    return {f"rng.{name}": hashlib.sha256(json.dumps(states[name], sort_keys=True).encode()).hexdigest()
            for name in PIECES if name in states}
