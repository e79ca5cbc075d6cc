"""The scenario registry: the built-in scenarios, plus those other packages add by entry point.

Built-ins (``BUILTIN``) load from the package itself, so an uninstalled tree (``PYTHONPATH=.``, as
benchmarks/gpu_check.sh runs) has them too. Plug-ins: entry-point group ``gpuregress.scenarios``
(docs/writing-a-scenario.md). Loading imports only session-side code: no torch.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib import metadata
from typing import Any

from ..errors import ScenarioProblem
from .base import Case, CheckScenario, Launch, RankContext, Scenario, Setup, TriageSupport, test_id
from .function import FunctionScenario

ENTRY_POINT_GROUP = "gpuregress.scenarios"
DISTRIBUTION = "pytest-gpuregress"  # this package: entry points it registered once (older releases) are skipped
# The built-in scenarios by name, in the order of their cases, as entry strings: resolved when the registry is
# first read, so importing this module imports no scenario.
BUILTIN: dict[str, str] = {
    "checkpoint": "pytest_gpuregress.scenarios.checkpoint:SCENARIO",
    "collectives": "pytest_gpuregress.scenarios.collectives:SCENARIO",
    "consensus": "pytest_gpuregress.scenarios.consensus:SCENARIO",
    "formats": "pytest_gpuregress.scenarios.formats:SCENARIO",
    "fsdp": "pytest_gpuregress.scenarios.fsdp:SCENARIO",
    "lora": "pytest_gpuregress.scenarios.lora:SCENARIO",
    "triage": "pytest_gpuregress.triage.scenario:SCENARIO",
}


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
        obj = resolve_entry(entry)
        scenario = obj() if isinstance(obj, type) else obj
        if not isinstance(scenario, Scenario) or not scenario.name or not scenario.rank_entry:
            raise ScenarioProblem(f"{origin}: not a scenario; subclass pytest_gpuregress.scenarios.Scenario and set "
                                  "name and rank_entry")
        return scenario
    except ScenarioProblem as exc:
        if origin == entry or str(exc).startswith(origin):  # a built-in, or a message that names it already
            raise
        raise ScenarioProblem(f"{origin}: {str(exc).removeprefix(f'{entry!r}: ')}") from None
    except Exception as exc:  # noqa: BLE001 - a plug-in's own code: any error, reported as its own
        detail = " ".join(str(exc).split())  # one line, whatever the exception's message
        raise ScenarioProblem(f"{origin}: {type(exc).__name__}: {detail}") from None


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "unknown package"


def _ours(ep: metadata.EntryPoint) -> bool:
    return _distribution(ep).replace("_", "-").lower() == DISTRIBUTION


@lru_cache(maxsize=1)
def registry() -> dict[str, Scenario]:
    """Every scenario by name: the built-ins (``BUILTIN``) first, then other packages' entry points in name order;
    this package's own entry points (an older release registered its built-ins so) are skipped."""
    found: dict[str, Scenario] = {}
    origins: dict[str, str] = {}

    def add(scenario: Scenario, origin: str) -> None:
        if scenario.name in found:
            raise ScenarioProblem(f"{origin}: scenario name {scenario.name!r} is taken by {origins[scenario.name]}")
        found[scenario.name] = scenario
        origins[scenario.name] = origin

    for name, entry in BUILTIN.items():
        add(_load(entry, entry), f"the built-in scenario {name} ({entry})")
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if _ours(ep) or (ep.name, ep.value) in seen:  # the same entry point twice: an editable install beside a build
            continue
        seen.add((ep.name, ep.value))
        origin = f"entry point {ep.name} = {ep.value} ({_distribution(ep)})"
        add(_load(ep.value, origin), origin)
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
           "TriageSupport", "get_scenario", "registry", "resolve_entry", "test_id"]
