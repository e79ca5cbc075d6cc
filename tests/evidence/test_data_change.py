"""Data that changed under the model (evidence/data_change.py): the token batches' digests decide that the run
trained on other data, and the per-stream digests name the random stream that drew other numbers."""

from __future__ import annotations

from pytest_gpuregress.comparison.compare import Comparison, Finding, data_finding
from pytest_gpuregress.evidence.data_change import BATCH_DIGEST, finding_text, first_changed_step, stream_changes, stream_series
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.triage.naming import name_findings

STREAMS = ("tokens", "python", "numpy", "torch_cpu", "device")


def record(batches: list[float], draws: list[dict[str, float]] | None = None, torch: str = "2.13.0") -> RunRecord:
    series = {"loss": [1.0] * len(batches), BATCH_DIGEST: batches, **stream_series(draws or [])}
    return RunRecord("checkpoint", {}, "cpu", 2, series=series,
                     fingerprint={"versions": {"torch": torch, "numpy": "2.4.6", "python": "3.12.3"}})


def named(findings: list[Finding]) -> list[tuple[str, str]]:
    """(component, rule) of each finding, as triage names them."""
    name_findings(Comparison("exact", "", findings, []))
    return [(f.component, f.rule) for f in findings]


def draws(steps: int, shifted_from: int | None = None, stream: str = "torch_cpu") -> list[dict[str, float]]:
    return [{name: float(step * 10 + i + (1000 if name == stream and shifted_from is not None and step >= shifted_from
                                           else 0)) for i, name in enumerate(STREAMS)} for step in range(steps)]


def test_same_batches_are_no_change() -> None:
    reference = record([1.0, 2.0, 3.0], draws(3))
    assert first_changed_step(reference, record([1.0, 2.0, 3.0], draws(3))) is None
    findings = [Finding("loss", "loss moved", step=4)]
    assert not data_finding(reference, record([1.0, 2.0, 3.0], draws(3)), findings)
    assert named(findings) == [("optimizer or collective", "later-steps")]


def test_a_shifted_random_stream_is_named_with_its_step_and_the_version_that_moved() -> None:
    reference = record([1.0, 2.0, 3.0], draws(3))
    run = record([1.0, 5.0, 6.0], draws(3, shifted_from=1), torch="2.14.1")
    assert stream_changes(reference, run) == [("torch_cpu", 1)]
    text = finding_text(reference, run, 1)
    assert "token batch of step 1 differs" in text and "2 of 3 steps' batches" in text
    assert "torch's CPU generator" in text and "from step 1, torch 2.13.0 -> 2.14.1" in text
    findings = [Finding("loss", "loss moved"), Finding("checkpoint", "bundle differs")]
    assert data_finding(reference, run, findings)
    assert named(findings) == [("data", "data-changed"), ("data", "follows-data"), ("data", "follows-data")]
    assert findings[0].step == 1 and findings[0].message == text


def test_streams_are_listed_earliest_first() -> None:
    reference = record([1.0, 2.0, 3.0], draws(3))
    moved = draws(3, shifted_from=2, stream="python")
    moved[1]["device"] += 1
    moved[1]["numpy"] += 1
    assert stream_changes(reference, record([1.0, 7.0, 8.0], moved)) == [("numpy", 1), ("device", 1), ("python", 2)]


def test_other_batches_with_every_stream_the_same_blame_the_pipelines_own_code() -> None:
    text = finding_text(record([1.0, 2.0], draws(2)), record([1.0, 9.0], draws(2)), 1)
    assert stream_changes(record([1.0, 2.0], draws(2)), record([1.0, 9.0], draws(2))) == []
    assert "every random stream rank 0 keeps" in text and "drew the same numbers" in text
    assert "the pipeline's own code changed" in text


def test_a_pipeline_without_streams_names_what_made_the_batches() -> None:
    text = finding_text(record([1.0, 2.0]), record([4.0, 2.0]), 0)
    assert "synthetic Markov chain" in text and "drawn with numpy 2.4.6" in text


def test_a_record_without_batch_digests_is_no_change() -> None:
    reference = RunRecord("checkpoint", {}, "cpu", 2, series={"loss": [1.0]})
    assert first_changed_step(reference, record([1.0])) is None


def test_what_moved_before_the_batches_did_and_a_failed_round_trip_keep_their_components() -> None:
    """A random draw in the step itself shifts only later batches: the finding of the step before keeps its name;
    a checkpoint whose arrays are missing failed its round trip, whatever the data."""
    from pytest_gpuregress.comparison.compare import ROUND_TRIP

    reference = record([1.0, 2.0, 3.0], draws(3))
    run = record([1.0, 2.0, 6.0], draws(3, shifted_from=2))
    findings = [Finding("loss", "moved at step 1", step=1), Finding("loss", "at 2", step=2),
                Finding(ROUND_TRIP, "2 of 9 arrays are missing"), Finding("final", "weights")]
    assert data_finding(reference, run, findings)
    assert [rule for _, rule in named(findings)] == ["data-changed", "later-steps", "follows-data", "round-trip",
                                                     "follows-data"]


def test_changed_tokens_are_named_by_what_made_them_not_as_a_random_stream() -> None:
    reference = record([1.0, 2.0], draws(2))
    run = record([1.0, 9.0], draws(2, shifted_from=1, stream="tokens"))
    run.config["tokens"] = "/data/tokens.bin"
    text = finding_text(reference, run, 1)
    assert "tokens themselves differ from step 1" in text and "the token file /data/tokens.bin" in text
    assert "random streams" not in text
