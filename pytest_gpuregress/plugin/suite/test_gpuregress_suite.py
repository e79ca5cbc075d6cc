"""The built-in suite that ``pytest --gpuregress`` runs: one test per case of every registered scenario.

Select with ``-k``, e.g. ``-k fsdp``, ``-k collectives`` or ``-k "all_reduce and bf16"``. The
plugin parametrises ``gpuregress_case`` from the scenario registry.
"""

from __future__ import annotations

import pytest

from pytest_gpuregress.plugin.session import GpuRegressSession

pytestmark = pytest.mark.gpuregress


def test_scenario(gpuregress: GpuRegressSession, gpuregress_case: tuple[str, str]) -> None:
    """One case of one scenario: a training run against its reference, or a check against its closed form."""
    scenario, case_id = gpuregress_case
    gpuregress.run_case(scenario, case_id)
