"""The built-in suite that ``pytest --gpuregress`` runs. Select with ``-k``, e.g.
``-k fsdp`` or ``-k "all_reduce and bf16"``."""

from __future__ import annotations

import pytest

from pytest_gpuregress.session import GpuRegressSession

pytestmark = pytest.mark.gpuregress

TRAINING_SCENARIOS = ["fsdp"]


@pytest.mark.gpuregress_training
@pytest.mark.parametrize("scenario", TRAINING_SCENARIOS)
def test_training_matches_reference(gpuregress: GpuRegressSession, scenario: str) -> None:
    """Fixed-seed training on every rank: losses, gradients and final weights against the reference."""
    record = gpuregress.run(scenario)
    gpuregress.check(record)


@pytest.mark.gpuregress_collectives
def test_collective(gpuregress: GpuRegressSession, collective_case: str) -> None:
    """One collective case against its closed-form result, bit for bit, summed over ranks.

    ``collective_case`` is parametrised by the plugin from this platform's sweep plan."""
    gpuregress.check_collective(collective_case)
