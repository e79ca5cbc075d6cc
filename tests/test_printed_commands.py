"""Every command the plugin prints selects the cases it claims to (#37): the advice written into the scenarios.

The record commands built from this run's setup name node ids (tests/scenarios/test_training_e2e.py and
tests/scenarios/test_user_models.py run them, for the built-in cases and for a project's own test); the gpuregress compare
commands are run where they are printed (conftest.reproduced). The advice here is fixed text inside the
scenarios, found in their source: it names built-in cases by node id, never by a -k that would also select a
project's own tests (``-k checkpoint`` re-records every test of a ``test_checkpointing.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pytest_gpuregress

from .conftest import collected

PACKAGE = Path(pytest_gpuregress.__file__).parent
# 'gpuregress::NAME*' in a string the plugin prints; {sc.name} or {self.name} is a training scenario's.
ADVICE = re.compile(r"'gpuregress::(\{(?:sc|self)\.name\}|[\w-]+)\*'")
# "pytest --gpuregress ... -k NAME" or "(-k NAME)": a -k the plugin would print as advice (over "..." f"..." too)
K_ADVICE = re.compile(r"""(?:pytest --gpuregress(?:[^"\n]|"\s*f?")*?|\()-k (\{sc\.name\}|\w+)""")
OPTIONS_FOR = {"consensus": ["--gpuregress-consensus"]}  # cases that exist only with their option


def printed_patterns() -> dict[str, list[str]]:
    """Each node-id pattern printed as advice, with the files that print it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in ADVICE.findall(path.read_text()):
            for each in (["fsdp", "lora"] if name in ("{sc.name}", "{self.name}") else [name]):
                found.setdefault(each, []).append(str(path.relative_to(PACKAGE)))
    return found


def test_the_advice_is_found_where_it_is_printed_and_none_of_it_is_a_k() -> None:
    found = printed_patterns()
    assert {"checkpoint", "collectives", "consensus", "formats", "fsdp", "lora"} <= set(found), found
    ks = {str(p.relative_to(PACKAGE)): K_ADVICE.findall(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {where: k for where, k in ks.items() if k} == {}


@pytest.mark.parametrize("name", sorted(printed_patterns()))
def test_each_printed_pattern_selects_built_in_cases_and_no_project_test(pytester: pytest.Pytester,
                                                                          name: str) -> None:
    # a project test whose name holds the scenario's: a -k would have selected it
    pytester.makepyfile(**{f"test_{name}_of_mine": f"def test_{name}_of_mine(gpuregress):\n    pass\n"})
    ids = collected(pytester, ["pytest", "--gpuregress", *OPTIONS_FOR.get(name, []), f"gpuregress::{name}*"])
    assert ids and all(i.startswith(f"gpuregress::{name}") for i in ids), (name, ids)
