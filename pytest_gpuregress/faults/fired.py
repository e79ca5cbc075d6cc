"""What an installer uses: ``Firing``, how often its fault acted, and ``patch``, which wraps a function for the
job. A leaf: faults/__init__.py names Firing for the installers' type, and firing.py (which reads the fault kinds)
sums it, without a circle between them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Firing:
    """One installed spec on one rank, and how often it acted. ``counted`` False: it cannot be counted."""

    spec: str
    count: int = 0
    counted: bool = True

    def fire(self, times: int = 1) -> None:
        self.count += times


def patch(ctx: Any, owner: Any, attr: str, wrapper: Callable[[Any], Any]) -> None:
    """Set ``owner.attr`` to ``wrapper(original)`` until the rank's cleanup hooks put the original back: ranks
    outlive a job."""
    original = getattr(owner, attr)
    setattr(owner, attr, wrapper(original))
    ctx.cleanup_hooks.append(lambda: setattr(owner, attr, original))
