"""Scenarios as plug-ins: the README's toy scenario, registered by entry point, runs like a built-in one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ..conftest import records_passes_and_breaks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_scenario" / "gpuregress_toy.py"


def install_entry_point(pytester: pytest.Pytester, name: str, value: str, dist: str = "gpuregress_toy") -> None:
    """What ``pip install`` of a package with a ``gpuregress.scenarios`` entry point leaves on sys.path."""
    info = pytester.path / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[gpuregress.scenarios]\n{name} = {value}\n")


@pytest.mark.slow
@pytest.mark.full_tier  # about 35 s: records, compares and breaks a plug-in end to end; the fast tier loads plug-ins
def test_toy_scenario_records_compares_and_fails_under_a_fault(pytester: pytest.Pytester, tmp_path: Path) -> None:
    shutil.copy(EXAMPLE, pytester.path / EXAMPLE.name)
    install_entry_point(pytester, "toy", "gpuregress_toy:SCENARIO")
    refs = tmp_path / "refs"
    args = ["-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}", "-k", "toy"]

    records_passes_and_breaks(pytester.runpytest_subprocess, args, refs, "toy",
                              "collective:op=all_reduce,mode=nudge,rel=1e-3", ["*loss: first differing step 0 of 20*"])

    listed = pytester.run("gpuregress", "scenarios")
    assert any(line.startswith("toy ") and "training" in line for line in listed.stdout.lines), listed.stdout.str()


def test_a_broken_plug_in_is_a_usage_error_naming_its_entry_point(pytester: pytest.Pytester) -> None:
    install_entry_point(pytester, "broken", "no_such_module:SCENARIO", dist="broken_pkg")
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gpuregress scenarios: entry point broken = no_such_module:SCENARIO (broken_pkg): "
                                 "cannot import no_such_module*"])
    # Without --gpuregress the plugin stays out of the way.
    pytester.makepyfile("def test_ok():\n    pass\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_a_plug_in_that_is_not_a_scenario_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(not_a_scenario="SCENARIO = object()\n")
    install_entry_point(pytester, "odd", "not_a_scenario:SCENARIO", dist="odd_pkg")
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*entry point odd = not_a_scenario:SCENARIO (odd_pkg): not a scenario*"])
