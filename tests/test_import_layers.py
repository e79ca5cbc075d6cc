"""No arrow back up, and no circles: the package's imports against the layers of docs/architecture.md.

Pure AST over pytest_gpuregress/**/*.py: nothing of the package is imported, so this runs in a blink.

Counted for the layer rule: every import statement of a module, wherever it stands: at the top, inside a
function (the usual way to hide an arrow back up) and under ``if TYPE_CHECKING:`` (a type named from a
higher layer is still a dependency on that layer; moving the type down is the fix).
Counted for circles: every import too, TYPE_CHECKING ones included: two modules that name each other's
types are one concern split in two, or share a piece that belongs in a module of its own.
Not counted: that importing ``a.b`` first runs ``a/__init__.py`` (Python's doing, not an arrow), and
entry strings (``"package.module:function"``) that the scenario registry and the launcher resolve at run
time, as they do a plug-in's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = "pytest_gpuregress"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / ROOT

# The neutral modules at the bottom: leaves every layer may use, and which may use one another.
NEUTRAL = ("errors", "units", "warn", "resources", "option_spec", "fault_points", "components", "findings", "kinds",
           "activities")
# Top to bottom, as docs/architecture.md draws them. A module may import its own package and anything in a
# lower layer; packages that share a layer may not import each other (but for the neutral modules).
LAYERS: tuple[tuple[str, ...], ...] = (
    (ROOT,),  # the package itself: its public face (Recorder, check, run)
    ("plugin", "cli"),
    ("launch",),
    ("triage", "faults", "recorder"),  # each uses scenarios; none uses another
    ("scenarios",),
    ("training",),
    ("comparison",),  # judging a run against its reference
    ("evidence",),  # what a run's data shows: op traces and their analyses, step 0, layout, data, kernels
    ("reference",),  # storage: the RunRecord and the store
    ("stack",),
    NEUTRAL,
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}

# Inside scenarios: each scenario folder depends on the core (the registry, base.py and the other top-level
# modules, shared/) and on lower layers, never on another scenario's folder; the core never on a folder.
SCENARIOS_CORE_FOLDERS = ("shared",)

# (importer, imported) -> why it is no arrow back up. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {
    (f"{ROOT}.launch.pool", ROOT): "the worker pool is kept on the package object, which pytester's inline runs "
                                   "never drop; nothing the package defines is used",
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    runs: bool  # False under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported}" + ("" if self.runs else " (TYPE_CHECKING)")


def package_modules(directory: Path = PACKAGE_DIR) -> dict[str, tuple[str, bool]]:
    """Module name -> (its source, whether it is a package's ``__init__``)."""
    modules = {}
    for path in sorted(directory.rglob("*.py")):
        parts = list(path.relative_to(directory.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST, runs: bool = True) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``tree``, with whether it runs (False inside ``if TYPE_CHECKING:``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, runs
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), runs=False)
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), runs)
        else:
            yield from _statements(node, runs)


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: Iterable[str]) -> list[str]:
    """The package's modules ``node`` imports: ``from p import m`` names module p.m where there is one, else p."""
    known = set(known)
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            module = alias.name
            while module and module not in known:
                module = module.rpartition(".")[0]
            found += [module] if module else []
        return found
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
    return [module for module in dict.fromkeys(found) if module in known]


def imports(modules: Mapping[str, tuple[str, bool]]) -> list[Import]:
    """Every import of one module of the package by another."""
    found = []
    for name, (source, is_package) in modules.items():
        for node, runs in _statements(ast.parse(source)):
            found += [Import(name, target, node.lineno, runs) for target in _targets(name, is_package, node, modules)
                      if target != name]
    return found


def package_of(module: str) -> str:
    """The layer entry a module belongs to: ``plugin`` for pytest_gpuregress.plugin.session, ``units`` for units."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def scenario_folder(module: str, modules: Mapping[str, tuple[str, bool]]) -> str | None:
    """The scenario folder a module of scenarios/ is in (``fsdp``), or None for the core."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "scenarios" or parts[2] in SCENARIOS_CORE_FOLDERS:
        return None
    in_folder = len(parts) > 3 or modules.get(module, ("", False))[1]  # scenarios/<folder>/..., not scenarios/<module>.py
    return parts[2] if in_folder else None


def upward(found: Iterable[Import], modules: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Each import from a higher layer, from a package of the same layer, or from another scenario's folder."""
    problems = []
    for imp in found:
        if (imp.importer, imp.imported) in ALLOWED:
            continue
        mine, theirs = package_of(imp.importer), package_of(imp.imported)
        if mine not in RANK or theirs not in RANK:
            continue  # test_every_module_has_a_layer names it
        if mine == theirs:
            if mine == "scenarios":
                folder, other = scenario_folder(imp.importer, modules), scenario_folder(imp.imported, modules)
                if other is not None and other != folder:
                    where = f"scenario folder {folder}" if folder else "the scenarios core"
                    problems.append(f"{imp}: {where} depends on scenario folder {other}; move what they share to "
                                    "scenarios/shared/ or a lower layer")
            continue
        if RANK[theirs] < RANK[mine]:
            problems.append(f"{imp}: {mine} is below {theirs}, an arrow back up")
        elif RANK[theirs] == RANK[mine] and mine not in NEUTRAL:
            problems.append(f"{imp}: {mine} and {theirs} share a layer and may not depend on each other")
    return problems


def circles(found: Iterable[Import]) -> list[str]:
    """Each group of modules that import each other round in a circle (TYPE_CHECKING imports too), with its arrows."""
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], Import] = {}
    for imp in found:
        edges.setdefault(imp.importer, set()).add(imp.imported)
        lines.setdefault((imp.importer, imp.imported), imp)
    problems = []
    for group in _strongly_connected(edges):
        arrows = sorted(str(lines[(a, b)]) for a in group for b in edges.get(a, ()) if b in group)
        problems.append(f"circle of {', '.join(sorted(group))}: " + "; ".join(arrows))
    return problems


def _strongly_connected(edges: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative; only the groups of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


# --- the package itself -------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({package_of(m) for m in package_modules()} - set(RANK))
    assert not unplaced, f"place these in LAYERS here and in docs/architecture.md: {', '.join(unplaced)}"


def test_no_module_imports_from_a_higher_layer() -> None:
    modules = package_modules()
    problems = upward(imports(modules), modules)
    assert not problems, "\n".join(problems)


def test_no_modules_import_each_other_in_a_circle() -> None:
    problems = circles(imports(package_modules()))
    assert not problems, "\n".join(problems)


# --- the checker, on made-up packages ---------------------------------------------------------------


def _tree(**sources: str) -> dict[str, tuple[str, bool]]:
    """Made-up modules: ``scenarios__fsdp__rank="..."`` is pytest_gpuregress/scenarios/fsdp/rank.py; a name
    ending in ``__init`` is a package."""
    modules = {}
    for key, source in sources.items():
        parts = key.split("__")
        is_package = parts[-1] == "init"
        modules[".".join([ROOT, *(parts[:-1] if is_package else parts)])] = (source, is_package)
    return modules


def test_a_scenario_importing_from_the_plugin_is_reported_wherever_the_import_stands() -> None:
    for source in ("from ...plugin.options import OptionSpec\n",
                   "def run():\n    from ...plugin import options\n",
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...plugin.options import OptionSpec\n"):
        modules = _tree(init="", plugin__init="", plugin__options="", scenarios__init="", scenarios__fsdp__init="",
                        scenarios__fsdp__rank=source)
        problems = upward(imports(modules), modules)
        assert len(problems) == 1 and problems[0].startswith(f"{ROOT}.scenarios.fsdp.rank:"), problems
        assert "scenarios is below plugin, an arrow" in problems[0]


def test_imports_down_and_within_a_package_are_not_reported() -> None:
    modules = _tree(init="", plugin__init="from ..scenarios import registry\n",
                    scenarios__init="from .base import Scenario\n", scenarios__base="from ..training import models\n",
                    training__init="", training__models="from . import data\nfrom ..errors import BadModel\n",
                    training__data="", errors="")
    assert upward(imports(modules), modules) == []


def test_one_scenario_folder_importing_another_is_reported() -> None:
    modules = _tree(init="", scenarios__init="", scenarios__base="def noise():\n    from .fsdp import perturbed\n",
                    scenarios__fsdp__init="", scenarios__lora__init="from ..fsdp import COMMON\n",
                    scenarios__shared__init="", scenarios__shared__config="")
    problems = upward(imports(modules), modules)
    assert [p.split(":")[0] for p in problems] == [f"{ROOT}.scenarios.base", f"{ROOT}.scenarios.lora"], problems
    assert ": the scenarios core depends on" in problems[0] and "on scenario folder fsdp;" in problems[0]
    assert ": scenario folder lora depends on" in problems[1] and "on scenario folder fsdp;" in problems[1]


def test_a_circle_is_reported_through_function_level_imports_and_through_type_checking() -> None:
    modules = _tree(init="", training__init="",
                    training__models="def build():\n    from .factory import FactoryModel\n",
                    training__factory="from .models import seed_parameters\n",
                    training__data="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .token_file import T\n",
                    training__token_file="from .data import rank_slice\n")
    problems = circles(imports(modules))
    assert problems == [f"circle of {ROOT}.training.data, {ROOT}.training.token_file: "
                        f"{ROOT}.training.data:3 imports {ROOT}.training.token_file (TYPE_CHECKING); "
                        f"{ROOT}.training.token_file:1 imports {ROOT}.training.data",
                        f"circle of {ROOT}.training.factory, {ROOT}.training.models: "
                        f"{ROOT}.training.factory:1 imports {ROOT}.training.models; "
                        f"{ROOT}.training.models:2 imports {ROOT}.training.factory"], problems


def test_a_longer_circle_through_package_inits_is_reported() -> None:
    modules = _tree(init="", cli__init="from . import plot\n", cli__plot="from ..reference import store\n",
                    reference__init="", reference__store="def f():\n    from ..cli import load_record\n")
    (problem,) = circles(imports(modules))
    assert problem.startswith(f"circle of {ROOT}.cli, {ROOT}.cli.plot, {ROOT}.reference.store: "), problem
