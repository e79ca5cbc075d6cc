"""One vocabulary of components (components.py), named in one place (triage/).

The scan reads the package's source (AST, nothing imported): every string given as a finding's component
(``component=...``, ``x.component = ...``, a module's ``COMPONENT``) and every message that begins with a
bracketed tag must use the vocabulary, and only triage/ may name one at all: a check reports what it saw, and
a check that named its own component would one day name the wrong one. A report refuses to print a name
outside the vocabulary, so a new name cannot reach a user without being added here first.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_gpuregress import components
from pytest_gpuregress.comparison.compare import Finding
from pytest_gpuregress.comparison.report import format_finding

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_gpuregress"
TAG = re.compile(r"^\[([a-z][a-z :_-]*)\] ")


TRIAGE = PACKAGE / "triage"


def _named_components(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "component" and isinstance(node.value, ast.Constant):
            yield node.value.lineno, node.value.value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in ("component", "COMPONENT"):
                    yield node.value.lineno, node.value.value


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


def test_no_module_outside_triage_names_a_component() -> None:
    """Checks, the comparator, scenarios and reports say what they saw; triage/naming.py and triage/decision.py
    name the component. components.py defines the words; a known issue's component comes from its TOML entry."""
    named = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if TRIAGE in path.parents or path.name == "components.py":
            continue
        tree = ast.parse(path.read_text())
        named += [f"{path.relative_to(PACKAGE.parent)}:{line}: component {name!r}"
                  for line, name in _named_components(tree) if name]
        named += [f"{path.relative_to(PACKAGE.parent)}:{line}: tag [{name}]"
                  for line, name in _tags(tree) if components.known(name)]
    assert not named, "a component named outside triage/:\n" + "\n".join(named)


def test_the_scan_sees_each_way_a_module_could_name_one() -> None:
    source = ('f = Finding("loss", "x", component="kernel")\nx.component = "collective"\nCOMPONENT = "checkpoint"\n'
              'line = f"[optimizer] the clip {x}"\n')
    tree = ast.parse(source)
    assert sorted(name for _, name in _named_components(tree)) == ["checkpoint", "collective", "kernel"]
    assert [name for _, name in _tags(tree)] == ["optimizer"]


def test_compound_and_library_names_are_made_of_the_vocabulary() -> None:
    assert components.known("collective or kernel") and components.known("optimizer or collective")
    assert components.known("library: peft") and components.parts("library: peft") == ["library"]
    assert not components.known("network") and not components.known("kernel or network") and not components.known("")


def test_a_report_refuses_a_component_outside_the_vocabulary() -> None:
    named = Finding("loss", "loss: ...", component="collective or kernel")
    assert format_finding(named)[0] == "[collective or kernel] loss: ..."
    with pytest.raises(ValueError, match="'network' is not one of collective, kernel"):
        format_finding(Finding("loss", "loss: ...", component="network"))
    with pytest.raises(ValueError, match="'' is not one of"):  # a finding triage never named is no report's to print
        format_finding(Finding("loss", "loss: ..."))
