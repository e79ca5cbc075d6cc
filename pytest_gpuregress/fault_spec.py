"""A validated fault spec, as a scenario may read it (``Setup.faults``): its kind and typed parameters.

Neutral: scenarios see the injected faults without an import up into faults/, which parses and
validates the specs (``faults.parse``) and installs them on the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FaultSpec:
    """A validated fault: its kind and typed parameters. ``text`` is what the user wrote."""

    kind: str
    params: dict[str, Any]
    text: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    @property
    def ranks(self) -> frozenset[int] | None:
        return self.params.get("ranks", self.params.get("rank"))


def emulated_ops(specs: tuple[FaultSpec, ...] | list[FaultSpec]) -> tuple[str, ...]:
    """Collective ops a fault shim provides on this backend (only ``premul_sum`` today)."""
    return ("premul_sum",) if any(s.kind == "emulate_premul_sum" for s in specs) else ()
