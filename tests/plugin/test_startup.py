"""Nothing paid without --gpuregress: the plugin imports nothing heavy and loads no scenario, not even a broken one.

benchmarks/startup.py measures what the plugin costs a pytest start-up.
"""

from __future__ import annotations

import pytest

from ..scenarios.test_scenario_plugins import install_entry_point

HEAVY = ("torch", "numpy", "ml_dtypes")
# All of the plugin a run without --gpuregress may import: what declaring the options and markers takes. Each
# module more is read (and assertion-rewritten: pytest rewrites its plugins' packages) in every pytest run.
STARTUP_MODULES = {
    "pytest_gpuregress", "pytest_gpuregress.plugin", "pytest_gpuregress.plugin.options",
    "pytest_gpuregress.option_spec", "pytest_gpuregress.kinds",
    "pytest_gpuregress.training", "pytest_gpuregress.training.noise",  # the replicas option's default and range
}
# Writes the modules a run imported, at its very end: what loading the plugin cost it.
MODULES_CONFTEST = """
import sys
from pathlib import Path


def pytest_unconfigure(config):
    Path("modules.txt").write_text("\\n".join(sorted(sys.modules)))
"""


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY or m.startswith("pytest_gpuregress.scenarios")]


def test_a_run_without_the_flag_imports_no_torch_numpy_or_scenario(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(MODULES_CONFTEST)
    result = pytester.runpytest_subprocess("--co", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout.str()
    modules = (pytester.path / "modules.txt").read_text().split()
    assert "pytest_gpuregress.plugin" in modules  # the plugin was loaded: the check below means something
    assert _heavy(modules) == []
    assert {m for m in modules if m.startswith("pytest_gpuregress")} <= STARTUP_MODULES


# A plug-in broken in each way its own code can break: the module, its import, its constructor.
BROKEN = {
    "syntax": ("def broken(:\n", "SyntaxError"),
    "import": ("import no_such_dependency\n", "cannot import broken_import (No module named 'no_such_dependency')"),
    "constructor": ("class Bad:\n    def __init__(self):\n        raise RuntimeError('no GPU here')\n"
                    "SCENARIO = Bad\n", "RuntimeError: no GPU here"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_plug_in_is_harmless_without_the_flag_and_one_usage_line_with_it(
        pytester: pytest.Pytester, kind: str) -> None:
    source, error = BROKEN[kind]
    module = f"broken_{kind}"
    pytester.makepyfile(**{module: source})
    install_entry_point(pytester, "broken", f"{module}:SCENARIO", dist="broken_pkg")
    pytester.makepyfile("def test_ok():\n    pass\n")

    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)

    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, result.stderr.str()
    assert errors[0].startswith(f"ERROR: gpuregress scenarios: entry point broken = {module}:SCENARIO (broken_pkg): ")
    assert error in errors[0]


def test_help_with_the_flag_lists_the_options_and_runs_nothing(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", "--help")
    assert result.ret == 0, result.stderr.str()[-2000:]
    result.stdout.fnmatch_lines(["*--gpuregress-record*"])
