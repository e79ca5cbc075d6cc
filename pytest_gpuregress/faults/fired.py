"""What an installed fault reports: how often it acted (``Firing``). A leaf: faults/__init__.py names it for the
installers' type, and firing.py (which reads the fault kinds) sums it, without a circle between them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Firing:
    """One installed spec on one rank, and how often it acted. ``counted`` False: it cannot be counted."""

    spec: str
    count: int = 0
    counted: bool = True

    def fire(self, times: int = 1) -> None:
        self.count += times
