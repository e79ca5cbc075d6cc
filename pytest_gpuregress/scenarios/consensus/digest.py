"""What a device sends for the vote: per tensor, 24 bytes, never the tensors themselves.

An 8-byte BLAKE2b hash decides agreement; float64 sum and sum of |x|, computed on the host from the copied
bytes (not by the device under test), say how far a differing tensor moved. Names are ``part|step|tensor``.
Torch-free at import.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BYTES_PER_TENSOR = 8 + 8 + 8  # hash, sum, magnitude
HASH_ARRAY = "consensus/hash"
STATS_ARRAY = "consensus/stats"


def entry_name(part: str, tensor: str, step: int | None = None) -> str:
    return f"{part}|{'' if step is None else step}|{tensor}"


def split_name(name: str) -> tuple[str, int | None, str]:
    """(part, step or None, tensor) of a digest name."""
    part, step, tensor = name.split("|", 2)
    return part, int(step) if step else None, tensor


def names_digest(names: list[str]) -> str:
    """A short hash of the workload's tensor list: devices whose lists differ ran another workload."""
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


@dataclass
class Digests:
    """The digests of one device's workload, in the order it produced them."""

    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)
    magnitudes: list[float] = field(default_factory=list)

    def add(self, part: str, tensor_name: str, tensor: Any, step: int | None = None) -> None:
        """Digest a torch tensor (any device, any dtype): copied to the host, hashed, summed in float64."""
        import torch

        host = tensor.detach().to("cpu").contiguous()
        raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        wide = host.to(torch.float64)
        self.names.append(entry_name(part, tensor_name, step))
        self.kinds.append(f"{str(host.dtype).removeprefix('torch.')}{list(host.shape)}")
        self.hashes.append(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big"))
        self.sums.append(float(wide.sum()))
        self.magnitudes.append(float(wide.abs().sum()))

    def arrays(self) -> dict[str, np.ndarray]:
        """What a rank hands back: one uint64 and one float64 array, 24 bytes per tensor."""
        return {HASH_ARRAY: np.array(self.hashes, dtype=np.uint64),
                STATS_ARRAY: np.array([self.sums, self.magnitudes], dtype=np.float64).T.copy()}


def hex_hashes(array: np.ndarray) -> list[str]:
    return [f"{int(h):016x}" for h in array]
