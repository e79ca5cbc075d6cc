"""Metrics produced anywhere (#37 item 5): ``gpuregress.check_metrics`` records a job's series with the tolerances
the user gives, passes unchanged, and fails naming the metric that moved beyond its rtol. No rank starts: the
metrics come from a file, as a parsed Megatron or torchtitan log would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpuregress.comparison.compare import compare_training
from pytest_gpuregress.comparison.metrics import metrics_record, tolerances
from pytest_gpuregress.comparison.report import format_margins

USER_TEST = '''
import json
from pathlib import Path


def test_my_job(gpuregress):
    metrics = json.loads((Path(__file__).parent / "metrics.json").read_text())
    gpuregress.check_metrics("my-job", loss=metrics["loss"], grad_norm=metrics["grad_norm"],
                             param_grad_norms=metrics["per_tensor"], rtol={"loss": 1e-3, "grad_norm": 1e-2})
'''
METRICS = {"loss": [5.5, 5.1, 4.8, 4.6], "grad_norm": [1.0, 0.9, 0.85, 0.8],
           "per_tensor": {"w": [0.5, 0.4, 0.4, 0.3], "b": [0.1, 0.1, 0.1, 0.1]}}


def run(pytester: pytest.Pytester, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "test_my_job.py", "-k", "test_my_job",
                              f"--gpuregress-reference-dir={pytester.path / 'refs'}", *extra)


def test_a_jobs_metrics_record_pass_unchanged_and_fail_naming_the_metric_beyond_its_rtol(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_my_job=USER_TEST)
    (pytester.path / "refs").mkdir()
    (pytester.path / "metrics.json").write_text(json.dumps(METRICS))
    run(pytester, "--gpuregress-record").assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "refs" / "my-job" / "metrics" / "record.json").read_text())
    assert stored["series"]["loss"] == METRICS["loss"]
    unchanged = run(pytester)
    unchanged.assert_outcomes(passed=1)
    unchanged.stdout.fnmatch_lines(["my-job metrics: PASSED [[]tolerant lane[]]*"])
    assert "step0_grad" not in unchanged.stdout.str() and "final_weights" not in unchanged.stdout.str()
    within = {**METRICS, "loss": [5.5, 5.1, 4.8 * (1 + 5e-4), 4.6]}  # inside loss's 1e-3
    (pytester.path / "metrics.json").write_text(json.dumps(within))
    run(pytester).assert_outcomes(passed=1)
    beyond = {**METRICS, "loss": [5.5, 5.1, 4.8 * (1 + 5e-3), 4.6]}
    (pytester.path / "metrics.json").write_text(json.dumps(beyond))
    failed = run(pytester)
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*] loss: first differing step 2 of 4*"])


def test_tolerances_name_only_metrics_and_a_metric_not_given_has_no_margin() -> None:
    with pytest.raises(ValueError, match="rtol names los, which are not metrics"):
        tolerances({"los": 1e-3})
    assert tolerances(1e-2).loss == 1e-2 and tolerances({"loss": 1e-3}).grad_norm == 2e-6
    assert tolerances(None) is None
    record = metrics_record("job", platform_key="metrics", fingerprint={}, loss=[1.0, 0.5])
    margins = format_margins(compare_training(record, record, lane="tolerant", tolerances=tolerances(1e-3)))
    assert "loss" in margins and "step0_grad" not in margins and "param_grad_norm" not in margins


def test_metrics_that_do_not_line_up_are_refused_naming_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grad_norm has 1 values, loss has 2"):
        metrics_record("job", platform_key="metrics", fingerprint={}, loss=[1.0, 0.5], grad_norm=[1.0])
    with pytest.raises(ValueError, match="loss is empty"):
        metrics_record("job", platform_key="metrics", fingerprint={}, loss=[])
    with pytest.raises(ValueError, match="not finite"):
        metrics_record("job", platform_key="metrics", fingerprint={}, loss=[1.0, float("nan")])


def test_replicas_given_at_recording_are_the_envelope_a_later_run_is_judged_by(tmp_path: Path) -> None:
    from pytest_gpuregress.errors import RegressionFailure
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.plugin.session import GpuRegressSession

    def session(**options: object) -> GpuRegressSession:
        return GpuRegressSession(Options(enabled=True, device="cpu", reference_dir=tmp_path / "refs", **options),
                                 tmp_path, output_dir=tmp_path / "artifacts")

    loss = [5.5, 5.1, 4.8, 4.6]
    reruns = [{"loss": [v * (1 + d) for v in loss]} for d in (1e-4, -1e-4)]  # the job's own run-to-run spread
    session(record=True).check_metrics("my-job", loss=loss, replicas=reruns)
    stored = json.loads((tmp_path / "refs" / "my-job" / "metrics" / "record.json").read_text())
    assert stored["series"]["loss"] == loss
    session(lane="tolerant").check_metrics("my-job", loss=[v * (1 + 5e-5) for v in loss])  # inside the spread
    with pytest.raises(RegressionFailure, match="loss: first differing step 0"):
        session(lane="tolerant").check_metrics("my-job", loss=[v * (1 + 1e-2) for v in loss])
