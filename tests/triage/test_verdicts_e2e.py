"""Verdicts from evidence, end to end (#46): faults of the kinds real bugs are, each named by the rule its evidence
decides, on two gloo ranks against a reference recorded here. A fault that starts late and acts on one rank only (a
warmed-up buffer pool) is the collective's by its own invariants; one rank's own GEMMs are [device]; other token
batches are [data]; a clip off its own norm is [optimizer]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import FSDP_ONLY, FSDP_STEPS

pytestmark = [pytest.mark.slow, pytest.mark.full_tier]


def run(tmp_path: Path, refs: Path, fault: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
           f"--gpuregress-reference-dir={refs}", "--gpuregress-lane=tolerant", "-k", FSDP_ONLY,
           f"--gpuregress-inject={fault}"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-4000:]
    return done.stdout


@pytest.mark.parametrize(("fault", "component", "rule", "evidence"), [
    ("collective:op=all_gather,mode=stale_chunk,from_step=4,ranks=0", "collective", "collective-invariants",
     "step 4: all_gather call"),
    ("linear_noise:rel=1e-4,ranks=1", "device", "one-rank", "rank 1 alone:"),
    ("library:mode=numpy_searchsorted", "data", "data", "the batches come from the synthetic Markov chain"),
    ("clip:mode=scale,rel=1e-3", "optimizer", "clip", "the clip scaled the gradients by"),
])
def test_each_fault_is_named_by_the_rule_its_evidence_decides(fsdp_reference: Path, tmp_path: Path, fault: str,
                                                              component: str, rule: str, evidence: str) -> None:
    out = run(tmp_path, fsdp_reference, fault)
    verdict = next((line for line in out.splitlines() if line.startswith("triage verdict:")), "")
    assert verdict.startswith(f"triage verdict: {component}. "), out[-6000:]
    assert f"Decided by rule {rule} (" in verdict and evidence in out, verdict
    assert f"[{component}]" in out
