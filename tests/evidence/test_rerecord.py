"""Re-recording only toward the truth: a reference is replaced only by a run no further from float64.

Unit tests judge synthetic distances; the end-to-end test (full tier) records fsdp, then re-records with a
float32 GEMM made 1e-5 less precise (refused, with both distances and the override) and on another CPU
kernel path (accepted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuregress.evidence import oracle_distance
from pytest_gpuregress.reference.record import RunRecord

from ..conftest import FSDP_ONLY, make_record


def _with_distances(**per_tensor: float) -> RunRecord:
    record = make_record()
    record.results[oracle_distance.RESULT_KEY] = {"per_tensor": per_tensor}
    return record


def test_a_run_no_further_from_float64_within_the_noise_may_replace_the_reference() -> None:
    old, new = _with_distances(a=2e-7, b=3e-7), _with_distances(a=2.5e-7, b=1e-7)
    judged = oracle_distance.judge_rerecording(old, new, {"a": 1e-7, "b": 1e-7})
    assert judged.allowed and judged.worse == [] and judged.reason.startswith("no further from float64")


def test_a_run_further_from_float64_is_refused_naming_both_distances_and_the_override() -> None:
    old, new = _with_distances(a=2e-7, b=3e-7), _with_distances(a=2e-5, b=3e-7)
    judged = oracle_distance.judge_rerecording(old, new, {"a": 1e-6, "b": 1e-6})
    assert not judged.allowed and [w[0] for w in judged.worse] == ["a"]
    text = judged.refusal("fsdp", "cpu-gloo-w2-fp32")
    assert judged.worse == [("a", 2e-7, 2e-5, 1e-6)]
    assert text.startswith("not re-recording 'fsdp' on cpu-gloo-w2-fp32: ") and "1 of 2 step-0 gradients" in text
    assert "a: 2e-07 -> 2e-05 from float64" in text and "(allowed up to 1.2e-06)" in text
    assert oracle_distance.OVERRIDE_FLAG in text


def test_an_old_reference_without_distances_is_not_judged() -> None:
    judged = oracle_distance.judge_rerecording(make_record(), _with_distances(a=1.0), {})
    assert judged.allowed and "not judged" in judged.reason


def test_distances_are_measured_per_step0_gradient() -> None:
    oracle = make_record()
    run = make_record()
    run.arrays["step0_grad/a.weight"] = oracle.arrays["step0_grad/a.weight"] * (1 + 1e-5)
    measured = oracle_distance.distances(run, oracle)
    assert measured["b.weight"] == 0.0 and 0.5e-5 < measured["a.weight"] < 2e-5


@pytest.mark.full_tier
def test_re_recording_is_refused_for_a_worse_stack_and_accepted_for_a_clean_other_one(tmp_path: Path) -> None:
    refs = tmp_path / "refs"

    def record(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        import os

        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-record",
               f"--gpuregress-reference-dir={refs}", "--gpuregress-steps=4", "-k", FSDP_ONLY, *extra]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                              env={**os.environ, **(env or {})})

    first = record()
    assert first.returncode == 0, first.stdout[-2000:]
    manifest = refs / "fsdp" / "cpu-gloo-w2-fp32" / "manifest.json"
    before = manifest.read_bytes()
    # The later recordings are judged against the first one's noise: they need no replicas of their own.
    worse = record("--gpuregress-inject=linear_noise:rel=1e-5", "--gpuregress-replicas=0")
    assert worse.returncode == 1
    # Most step-0 gradients (the norms' weights may stay as close to float64: the noise is in F.linear's output)
    moved = re.search(r"not re-recording 'fsdp' on cpu-gloo-w2-fp32: (\d+) of 21 step-0 gradients moved further from "
                      r"float64", worse.stdout)
    assert moved is not None and int(moved.group(1)) >= 15, worse.stdout[-2000:]
    assert "--gpuregress-record-anyway" in worse.stdout and manifest.read_bytes() == before  # left as it was
    other = record("--gpuregress-replicas=0", env={"ATEN_CPU_CAPABILITY": "default"})  # a clean, different stack
    assert other.returncode == 0, other.stdout[-2000:]
    assert "re-recorded: no further from float64" in other.stdout and "within the measured noise" in other.stdout
    forced = record("--gpuregress-inject=linear_noise:rel=1e-5", "--gpuregress-record-anyway", "--gpuregress-replicas=0")
    assert forced.returncode == 0, forced.stdout[-2000:]
    assert "(--gpuregress-record-anyway: " in forced.stdout and ": recorded anyway)" in forced.stdout
