"""The scenario registry: the built-in scenarios, plus those other packages add by entry point.

A package adds scenarios under the entry-point group ``gpuregress.scenarios``; each entry point
names a ``Scenario`` instance (or a class to instantiate)::

    [project.entry-points."gpuregress.scenarios"]
    toy = "mypkg.toy:SCENARIO"

``gpuregress scenarios`` lists what is installed. Loading imports only session-side code: no torch.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib import metadata
from typing import Any

from ..errors import ScenarioProblem
from .base import Case, CheckScenario, FunctionScenario, Launch, RankContext, Scenario, Setup

ENTRY_POINT_GROUP = "gpuregress.scenarios"
BUILTIN = (
    "pytest_gpuregress.scenarios.fsdp:SCENARIO",
    "pytest_gpuregress.scenarios.collectives:SCENARIO",
    "pytest_gpuregress.scenarios.triage:SCENARIO",
    "pytest_gpuregress.scenarios.formats:SCENARIO",
    "pytest_gpuregress.scenarios.lora:SCENARIO",
    "pytest_gpuregress.scenarios.checkpoint:SCENARIO",
)


def resolve_entry(entry: str) -> Any:
    """Import ``"package.module:attr"``; a clear error names what was not found."""
    module_name, _, attr = entry.partition(":")
    if not attr:
        raise ScenarioProblem(f"{entry!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ScenarioProblem(f"{entry!r}: cannot import {module_name} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ScenarioProblem(f"{entry!r}: module {module_name} has no attribute {attr!r}") from None


def _load(entry: str, origin: str) -> Scenario:
    """The scenario ``entry`` names. Whatever breaks (a missing module, a syntax error, a raising constructor)
    becomes one ScenarioProblem that says where the scenario came from."""
    try:
        return _as_scenario(resolve_entry(entry), origin)
    except ScenarioProblem as exc:
        if origin == entry or str(exc).startswith(origin):  # a built-in, or a message that names it already
            raise
        raise ScenarioProblem(f"{origin}: {str(exc).removeprefix(f'{entry!r}: ')}") from None
    except Exception as exc:  # noqa: BLE001 - a plug-in's own code: any error, reported as its own
        detail = " ".join(str(exc).split())  # one line, whatever the exception's message
        raise ScenarioProblem(f"{origin}: {type(exc).__name__}: {detail}") from None


def _as_scenario(obj: Any, origin: str) -> Scenario:
    scenario = obj() if isinstance(obj, type) else obj
    if not isinstance(scenario, Scenario) or not scenario.name or not scenario.rank_entry:
        raise ScenarioProblem(
            f"{origin}: not a scenario; subclass pytest_gpuregress.scenarios.Scenario and set name and rank_entry"
        )
    return scenario


@lru_cache(maxsize=1)
def registry() -> dict[str, Scenario]:
    """Every scenario by name: built-ins first, then entry points in name order."""
    found: dict[str, Scenario] = {}
    origins: dict[str, str] = {}
    sources = [(entry, entry) for entry in BUILTIN]
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        sources.append((ep.value, f"entry point {ep.name} = {ep.value} ({dist.name if dist else 'unknown package'})"))
    for entry, origin in sources:
        scenario = _load(entry, origin)
        if scenario.name in found:
            if origins[scenario.name] == origin:
                continue  # the same entry point seen twice (an editable install next to a build)
            raise ScenarioProblem(f"{origin}: scenario name {scenario.name!r} is taken by {origins[scenario.name]}")
        found[scenario.name] = scenario
        origins[scenario.name] = origin
    return found


def get_scenario(name: str) -> Scenario:
    """A registered scenario by name, or a user's ``"module:function"`` training entry."""
    scenarios = registry()
    if name in scenarios:
        return scenarios[name]
    if ":" in name:
        return FunctionScenario(entry=name)
    raise ScenarioProblem(f"unknown scenario {name!r}; installed: {', '.join(scenarios)}")


__all__ = ["Case", "CheckScenario", "FunctionScenario", "Launch", "RankContext", "Scenario", "Setup",
           "get_scenario", "registry", "resolve_entry"]
