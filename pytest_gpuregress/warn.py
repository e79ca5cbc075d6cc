"""Warnings that point at the test, not at a line inside the plugin.

The file and line shown are those of the innermost caller outside this package, or of the built-in
suite's test function. Torch-free.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SUITE = PACKAGE / "plugin" / "suite"


def warn_at_test(message: Warning) -> None:
    """``warnings.warn(message)`` attributed to the test that led here."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if PACKAGE not in path.parents or SUITE in path.parents:
            break
        frame = frame.f_back
    if frame is None:  # called from no test at all (a script): the caller's line
        warnings.warn(message, stacklevel=2)
        return
    warnings.warn_explicit(message, type(message), filename=frame.f_code.co_filename, lineno=frame.f_lineno,
                           module=frame.f_globals.get("__name__"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))
