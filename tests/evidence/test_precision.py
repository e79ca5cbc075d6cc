"""A bf16 run held to its reference's distance from float64 (evidence/oracle_distance.py's precision_problem): a
stack that computes bf16 with less precision (RMSNorm without its float32 upcast) lands further from float64 on
most step-0 gradients, which the tolerant lane's replica spread (16% to 82% of a gradient's largest element) cannot
see; another kernel path of the same precision lands about as far, and passes."""

from __future__ import annotations

from pytest_gpuregress.evidence import oracle_distance
from pytest_gpuregress.reference.record import RunRecord

from ..conftest import compare_named, make_record

NAMES = [f"model.layers.{i}.w" for i in range(6)]


def with_distances(record: RunRecord, scale: float, dtype: str = "bf16") -> RunRecord:
    record.config = {**record.config, "dtype": dtype}
    record.results[oracle_distance.RESULT_KEY] = {"per_tensor": {n: 0.005 * scale * (1 + i / 10)
                                                                 for i, n in enumerate(NAMES)}, "median": 0.005}
    return record


def test_a_run_as_far_from_float64_as_its_reference_passes() -> None:
    reference = with_distances(make_record(), 1.0)
    assert oracle_distance.precision_problem(reference, with_distances(make_record(), 1.1)) is None
    assert oracle_distance.judges_precision(with_distances(make_record(), 1.0))


def test_a_run_further_from_float64_than_the_ratio_allows_fails_naming_the_distances() -> None:
    reference = with_distances(make_record(), 1.0)
    text = oracle_distance.precision_problem(reference, with_distances(make_record(), 2.0))
    assert text is not None and "median distance 0.00625 -> 0.0125" in text and "(2.00x, allowed 1.15x)" in text
    assert "6 of 6 gradients further" in text and "less precision" in text
    comparison = compare_named(reference, with_distances(make_record(), 2.0), lane="tolerant")
    found = [f for f in comparison.findings if f.metric == "step0_precision"]
    assert len(found) == 1 and found[0].component == "kernel or library" and not comparison.passed


def test_fp32_runs_and_sides_without_distances_are_not_judged() -> None:
    reference = with_distances(make_record(), 1.0, dtype="fp32")
    assert oracle_distance.precision_problem(reference, with_distances(make_record(), 9.0, dtype="fp32")) is None
    assert not oracle_distance.judges_precision(with_distances(make_record(), 1.0, dtype="fp32"))
    bare = make_record()
    bare.config = {**bare.config, "dtype": "bf16"}
    assert oracle_distance.precision_problem(with_distances(make_record(), 1.0), bare) is None
