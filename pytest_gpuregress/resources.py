"""Shipped data: the model configs in ``models/`` and the references in ``reference_runs/``.

Both live at the repository's top level and are reached through ``importlib.resources`` as
``pytest_gpuregress/_data/<name>``: in a checkout or editable install ``_data`` holds symbolic
links to the top-level folders, and a built wheel carries the folders themselves there (hatchling
follows the links). One lookup serves both.
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
