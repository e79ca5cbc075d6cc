"""The scenario registry. Names map to import paths so that listing them imports no torch."""

from __future__ import annotations

from typing import Any

from .base import FunctionScenario, RankContext, Scenario, resolve_entry

BUILTIN: dict[str, str] = {
    "fsdp": "pytest_gpuregress.scenarios.fsdp:SCENARIO",
    "collectives": "pytest_gpuregress.scenarios.collectives:SCENARIO",
}


def get_scenario(name: str) -> Scenario:
    """A built-in scenario by name, or a user's ``"module:function"`` training entry."""
    if name in BUILTIN:
        scenario: Any = resolve_entry(BUILTIN[name])
        return scenario
    if ":" in name:
        return FunctionScenario(entry=name)
    raise KeyError(f"unknown scenario {name!r}; built-in scenarios: {sorted(BUILTIN)}")


__all__ = ["BUILTIN", "FunctionScenario", "RankContext", "Scenario", "get_scenario"]
