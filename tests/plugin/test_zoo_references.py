"""The model zoo against its shipped references, as a user runs it: every case of tiny-moe and tiny-llama-tied
passes, and the MoE's reference routed tokens to every expert. The full tier only (about 3 minutes on 2 cores); a
file of its own so that a parallel run places it beside the main job."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuregress.reference.record import RunRecord

from .test_shipped_references import SHIPPED, gpuregress

# CPU-sensitive: against shipped references, so .ci/run runs it once, on the kernel path they were recorded on.
pytestmark = [pytest.mark.slow, pytest.mark.full_tier, pytest.mark.cpu_sensitive]
ZOO = ("tiny-moe", "tiny-llama-tied")
SCENARIOS = ("fsdp", "lora", "checkpoint", "formats")


def test_the_zoo_models_pass_against_their_shipped_references(tmp_path: Path) -> None:
    done = gpuregress(tmp_path, *(f"--gpuregress-model={m}" for m in ZOO), "-k", " or ".join(ZOO))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "ForeignReference" not in done.stdout and "no reference" not in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(tuple(f"{s}-" for s in SCENARIOS))]
    for model in ZOO:
        for row in (f"{s}-{model} cpu-gloo-w2-fp32" for s in ("fsdp", "checkpoint", "formats")):
            assert any(line.startswith(f"{row}: PASSED [") for line in rows), (row, rows)
        for lane in ("fsdp2", "accelerate"):
            assert any(line.startswith(f"lora-{model} cpu-gloo-w2-fp32-{lane}: PASSED [") for line in rows), (model, lane)


def test_the_moe_reference_routes_tokens_to_every_expert() -> None:
    """A router that sent every token to one expert would train a dense model and call it an MoE."""
    load = RunRecord.load(SHIPPED / "fsdp-tiny-moe" / "cpu-gloo-w2-fp32").results["expert_load"]
    assert len(load) == 2 and all(abs(sum(row) - 1) < 1e-9 and min(row) > 0.05 for row in load)
