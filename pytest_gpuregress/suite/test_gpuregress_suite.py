"""The built-in suite that ``pytest --gpuregress`` runs. Select scenarios with ``-k``."""

from __future__ import annotations

import pytest

from pytest_gpuregress.session import GpuRegressSession

pytestmark = pytest.mark.gpuregress

TRAINING_SCENARIOS = ["fsdp"]


@pytest.mark.gpuregress_training
@pytest.mark.parametrize("scenario", TRAINING_SCENARIOS)
def test_training_matches_reference(gpuregress: GpuRegressSession, scenario: str) -> None:
    """Fixed-seed training on every rank: losses, gradients and final weights against the reference."""
    __tracebackhide__ = True
    record = gpuregress.run(scenario)
    gpuregress.check(record)
