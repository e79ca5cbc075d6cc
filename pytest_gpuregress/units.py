"""Sizes in bytes, read and written the way people type them (4MiB, 512K, 65536). torch-free."""

from __future__ import annotations

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'4MiB', '512K', '1G' or a plain number of bytes. Raises ValueError on anything else."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if not t:
        raise ValueError(f"not a size: {text!r}")
    if t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
