"""Every command the plugin prints selects the cases it claims to (#37): the -k expressions written into advice.

The record commands built from this run's setup name node ids (tests/test_training_e2e.py runs them, for the
built-in cases and for a project's own test); the gpuregress compare commands are run where they are printed
(conftest.reproduced). The advice here is fixed text inside the scenarios, found in their source.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pytest_gpuregress

from .conftest import collected

PACKAGE = Path(pytest_gpuregress.__file__).parent
# "pytest --gpuregress ... -k NAME" or "(-k NAME)" in a string the plugin prints; {sc.name} is a training scenario's.
ADVICE = re.compile(r"""(?:pytest --gpuregress(?:[^"\n]|"\s*f?")*?|\()-k (\{sc\.name\}|\w+)""")  # over "..." f"..." too
OPTIONS_FOR = {"consensus": ["--gpuregress-consensus"]}  # cases that exist only with their option


def printed_selections() -> dict[str, list[str]]:
    """Each -k expression printed as advice, with the files that print it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for expression in ADVICE.findall(path.read_text()):
            for name in (["fsdp", "lora"] if expression == "{sc.name}" else [expression]):
                found.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    return found


def test_the_advice_is_found_where_it_is_printed() -> None:
    found = printed_selections()
    assert {"checkpoint", "collectives", "consensus", "formats", "fsdp", "lora"} <= set(found), found


@pytest.mark.parametrize("expression", sorted(printed_selections()))
def test_each_printed_selection_selects_built_in_cases(pytester: pytest.Pytester, expression: str) -> None:
    command = ["pytest", "--gpuregress", *OPTIONS_FOR.get(expression, []), "-k", expression]
    ids = collected(pytester, command)
    assert ids and all(i.startswith("gpuregress::") and expression in i for i in ids), (expression, ids)
