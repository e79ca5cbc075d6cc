"""benchmarks/gpu_check.sh in its CPU dry run: the steps the one GPU run will take, with the same paths and
options, run here first, so a wrong path or option fails in CI rather than on the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
STEPS = ("env", "platform-key", "record", "reference-at-key", "compare", "triage", "sdpa-backend", "sdpa-forced",
         "host-op", "inventory", "protocols", "collective-fault", "sweep-bench")


@pytest.mark.slow
@pytest.mark.full_tier  # about 100 s on 2 cores: the full tier, which CI runs
def test_the_dry_run_meets_every_expectation_and_tables_each_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=900)
    table = (tmp_path / "table.txt").read_text()
    assert result.returncode == 0, table + result.stdout[-6000:] + result.stderr[-2000:]
    header, *rows, footer = table.splitlines()
    assert header.split() == ["step", "expected", "outcome", "seconds", "verdict"]
    assert [row.split()[0] for row in rows] == list(STEPS)
    assert all(row.split()[-1] == "ok" for row in rows), table
    assert "dry run (CPU), platform key cpu-gloo-w2-fp32" in footer and "every step as expected" in footer
    # The CPU's own expectations: 2 gloo ranks catch the collective fault, and gloo has no NCCL protocols.
    by_step = {row.split()[0]: row for row in rows}
    assert "fail /wrong elements/" in by_step["collective-fault"]
    assert "pass /does not apply to gloo/" in by_step["protocols"]
    # The GPU run's estimated time, for one GPU and for eight, from the steps it launches.
    budget = (tmp_path / "budget.txt").read_text()
    assert "GPU budget estimate (one GPU, 100 steps, 2 replicas): " in budget and "(2+ GPUs, " in budget


def test_a_step_that_differs_from_its_expectation_fails_the_check(tmp_path: Path) -> None:
    # A budget spent before the first step: every step is "not run", which no expectation allows. No rank starts.
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_CHECK_BUDGET": "1"}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    table = (tmp_path / "table.txt").read_text()
    assert result.returncode == 1, table
    rows = table.splitlines()[1:-1]
    assert [row.split()[0] for row in rows] == list(STEPS) and all(row.split()[-1] == "DIFFERS" for row in rows)
    assert "SOME STEPS DIFFER FROM THEIR EXPECTATION" in table
