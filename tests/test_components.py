"""One vocabulary of components (components.py): what every finding names, and what a report may print.

The scan reads the package's source (AST, nothing imported): every string given as a finding's component
(``component=...``, ``x.component = ...``, ``Finding(metric, "<component>", ...)``, a module's ``COMPONENT``)
and every message that begins with a bracketed tag must use the vocabulary. A report refuses to print a name
outside it, so a new name cannot reach a user without being added here first.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_gpuregress import components
from pytest_gpuregress.reference.compare import Finding
from pytest_gpuregress.reference.report import format_finding

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_gpuregress"
TAG = re.compile(r"^\[([a-z][a-z :_-]*)\] ")


def _comparison_findings(tree: ast.AST) -> bool:
    """Whether ``Finding`` in this module is the comparison's (formats/diagnose.py has a Finding of its own)."""
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").endswith("compare")
               and any(alias.name == "Finding" for alias in node.names) for node in ast.walk(tree)) or any(
        isinstance(node, ast.ClassDef) and node.name == "Comparison" for node in ast.walk(tree))


def _named_components(tree: ast.AST) -> Iterator[tuple[int, str]]:
    findings = _comparison_findings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "component" and isinstance(node.value, ast.Constant):
            yield node.value.lineno, node.value.value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in ("component", "COMPONENT"):
                    yield node.value.lineno, node.value.value
        elif (findings and isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            yield node.args[1].lineno, node.args[1].value


def _tags(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found = TAG.match(node.value)
            if found:
                yield node.lineno, found.group(1)


def test_every_component_the_package_names_is_in_the_vocabulary() -> None:
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for line, name in _named_components(tree):
            if name and not components.known(name):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line}: component {name!r}")
        for line, name in _tags(tree):
            if not components.known(name) and name not in components.OTHER_TAGS:
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line}: tag [{name}]")
    assert not outside, "outside components.COMPONENTS:\n" + "\n".join(outside)


def test_compound_and_library_names_are_made_of_the_vocabulary() -> None:
    assert components.known("collective or kernel") and components.known("optimizer or collective")
    assert components.known("library: peft") and components.parts("library: peft") == ["library"]
    assert not components.known("network") and not components.known("kernel or network") and not components.known("")


def test_a_report_refuses_a_component_outside_the_vocabulary() -> None:
    assert format_finding(Finding("loss", "collective or kernel", "loss: ..."))[0] == "[collective or kernel] loss: ..."
    with pytest.raises(ValueError, match="'network' is not one of collective, kernel"):
        format_finding(Finding("loss", "network", "loss: ..."))
