"""pytest-gpuregress: regression tests for the numerics of a training stack."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recorder import Recorder

__version__ = "0.1.0"
__all__ = ["Recorder", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the plugin loads this package in every pytest run, with or without --gpuregress.
    if name == "Recorder":
        from .recorder import Recorder

        return Recorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
