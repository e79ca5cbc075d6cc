"""Reports people read later: the plot, the summary table, and the progress line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.comparison.compare import compare_training
from pytest_gpuregress.comparison.plot import PlotsUnavailable, plot_comparison
from pytest_gpuregress.launch.job import Job
from pytest_gpuregress.launch.spawn import describe_progress, scenario_label
from pytest_gpuregress.plugin.outcomes import Outcome, summary_table

from ..conftest import make_record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def diverging_pair() -> tuple:
    reference = make_record(steps=30)
    run = make_record(steps=30)
    run.series = {k: list(np.asarray(v) * np.where(np.arange(30) >= 12, 1.01, 1.0)) for k, v in run.series.items()}
    return reference, run


def test_the_plot_of_a_failed_comparison_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    reference, run = diverging_pair()
    comparison = compare_training(reference, run, lane="tolerant")
    assert not comparison.passed
    path = plot_comparison(reference, run, tmp_path / "out" / "fsdp.png", comparison)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert not list(path.parent.glob(".*tmp*"))  # written atomically


def test_the_plot_of_a_run_whose_model_layout_changed_draws(tmp_path: Path) -> None:
    # A [model] finding: the library split a parameter, so the runs have different parameter lists.
    pytest.importorskip("matplotlib")
    reference, run = make_record(steps=10), make_record(steps=10)
    run.param_names = ["a.weight", "b.0.weight", "b.1.weight"]
    run.arrays["param_grad_norm"] = np.ones((10, 3))
    path = plot_comparison(reference, run, tmp_path / "model.png", compare_training(reference, run, lane="tolerant"))
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_the_plot_of_a_reference_alone_draws_its_band(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot_comparison(make_record(steps=10), None, tmp_path / "ref.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_without_matplotlib_the_plot_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    reference, run = diverging_pair()
    with pytest.raises(PlotsUnavailable, match=r"pip install 'pytest-gpuregress\[plots\]'"):
        plot_comparison(reference, run, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_a_failure_report_says_how_to_get_plots(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    from pytest_gpuregress.plugin.pipeline import Artifacts

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    reference, run = diverging_pair()
    kept = Artifacts(tmp_path).keep("fsdp", run, reference, compare_training(reference, run), keep_run=True, plot=True)
    lines = kept.report_lines(tmp_path / "ref")
    assert "plot: none (plots need matplotlib: pip install 'pytest-gpuregress[plots]')" in lines
    assert any(line.startswith("reproduce the comparison: gpuregress compare ") for line in lines)


def test_the_summary_table_has_one_row_per_scenario_and_the_command_for_each_failure() -> None:
    outcomes = [Outcome("fsdp", "cpu-gloo-w2-fp32", "failed", "exact", worst=1.4e4, seconds=12.3,
                        reproduce="gpuregress compare A B"),
                Outcome("lora", "cpu-gloo-w2-fp32-fsdp2", "passed", "tolerant", worst=0.31, seconds=8.0),
                Outcome("formats", "cpu-gloo-w2-fp32", "error", reproduce="pytest --gpuregress --gpuregress-record")]
    lines = summary_table(outcomes)
    assert lines[1].split() == ["scenario", "platform", "lane", "verdict", "worst/tol", "seconds"]
    assert lines[2].split() == ["fsdp", "cpu-gloo-w2-fp32", "exact", "FAILED", "1.4e+04x", "12.3"]
    assert lines[3].split() == ["lora", "cpu-gloo-w2-fp32-fsdp2", "tolerant", "PASSED", "0.31x", "8.0"]
    assert lines[4].split() == ["formats", "cpu-gloo-w2-fp32", "-", "ERROR", "-", "-"]
    assert lines[5:] == ["reproduce fsdp: gpuregress compare A B",
                         "reproduce formats: pytest --gpuregress --gpuregress-record"]


def test_progress_reads_as_step_n_of_total() -> None:
    job = Job(scenario="pytest_gpuregress.scenarios.fsdp.rank:run", config={"steps": 300}, world_size=2,
              device_kind="cpu", backend="gloo", run_dir="/tmp", timeout_s=1)
    assert describe_progress("step 56 done, loss 3.2, grad_norm 0.5", job) == "step 57 of 300, loss 3.2, grad_norm 0.5"
    assert describe_progress("model built", job) == "model built"
    assert scenario_label(job.scenario) == "fsdp"
    assert scenario_label("user_scenario:train") == "user_scenario"
    replica = Job(scenario=job.scenario, config={"steps": 300, "perturbation": "reduction_order"}, world_size=2,
                  device_kind="cpu", backend="gloo", run_dir="/tmp", timeout_s=1)
    assert describe_progress("step 54 done, loss 3.2", replica) == "replica 2 (reduction_order): step 55 of 300, loss 3.2"


def test_progress_says_about_how_long_is_left_at_the_pace_so_far() -> None:
    from pytest_gpuregress.launch.spawn import time_left

    job = Job(scenario="pytest_gpuregress.scenarios.fsdp.rank:run", config={"steps": 300}, world_size=2,
              device_kind="cpu", backend="gloo", run_dir="/tmp/a", timeout_s=1)
    pace: dict = {}
    assert time_left("step 9 done, loss 3.2", job, pace, now=100.0) == ""  # one step seen: no pace yet
    assert time_left("step 19 done, loss 3.1", job, pace, now=105.0) == ", about 2m20s left"  # 0.5 s a step, 280 left
    assert time_left("step 298 done, loss 1.0", job, pace, now=244.5) == ", about 0s left"
    assert time_left("model built", job, pace, now=245.0) == ""


def test_a_plugin_warning_points_at_the_test_that_led_to_it() -> None:
    """pytest shows a warning's file and line: a perf, kernel or format warning names the test, not a line
    inside the plugin (it used to show plugin/session.py)."""
    from pytest_gpuregress.reference.record import RunRecord
    from pytest_gpuregress.scenarios.formats import SCENARIO, judge

    record = RunRecord(scenario="formats", config={}, platform_key="cpu", world_size=2,
                       results={"session": {"format_changes": "warn"}})
    with pytest.warns(judge.FormatBehaviourChanged) as caught:
        SCENARIO._behaviour(["overflow to e4m3fn now gives NaN"], record)
    assert caught[0].filename == __file__


def test_the_built_in_suite_counts_as_the_test() -> None:
    from pytest_gpuregress.warn import SUITE, warn_at_test

    code = compile("def run(warn, message):\n    warn(message)\n", str(SUITE / "cases.py"), "exec")
    namespace: dict[str, object] = {"__name__": "pytest_gpuregress.plugin.suite.cases"}
    exec(code, namespace)
    with pytest.warns(UserWarning) as caught:
        namespace["run"](warn_at_test, UserWarning("perf"))  # type: ignore[operator]
    assert caught[0].filename == str(SUITE / "cases.py")
