"""Shipped data: the model configs in ``models/`` and the references in ``reference_runs/``.

Reached as ``pytest_gpuregress/_data/<name>`` through ``importlib.resources``: symbolic links in a
checkout, the folders themselves in a wheel (hatchling follows the links).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SHIPPED = ("models", "reference_runs")


def shipped_dir(name: str) -> Path:
    """The shipped ``models`` or ``reference_runs`` folder."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped data folder {name!r}; known: {SHIPPED}")
    return Path(str(resources.files("pytest_gpuregress") / "_data" / name)).resolve()
