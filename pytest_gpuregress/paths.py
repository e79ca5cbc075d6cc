"""Where shipped data lives: ``models/`` and ``reference_runs/``.

In a source checkout or editable install they sit beside the package; a built wheel carries
them inside it under ``pytest_gpuregress/_data/`` (see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The shipped ``name`` directory (``models`` or ``reference_runs``)."""
    for candidate in (PACKAGE_DIR / "_data" / name, PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    return PACKAGE_DIR / "_data" / name
