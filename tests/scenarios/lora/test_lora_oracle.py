"""The lora scenario's float64 oracle (scenarios/lora/oracle.py): its launch (one rank, no faults, no wrapper), and
its run in process: step 0 of the same adapter on the same global batch in float64, which the fp32 run at one rank
matches to fp32's precision, while another seed does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.evidence import step0
from pytest_gpuregress.evidence.oracle_step0 import MODE_KEY
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import resolve_entry
from pytest_gpuregress.scenarios.lora import checks
from pytest_gpuregress.scenarios.lora.oracle import ENTRY, launch, run

from ..conftest import rank_context, tiny_lora_config


def oracle_of(tmp_path: Path, **changes: object) -> RunRecord:
    """The oracle's record for the tiny lora config (with ``changes``), run as its launch configures it."""
    planned = launch(tiny_lora_config(**changes))
    return run(rank_context(planned.config, tmp_path))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    return oracle_of(tmp_path_factory.mktemp("lora-oracle"))


def test_the_oracle_launches_one_rank_without_faults_and_serves_both_wrappers() -> None:
    """One launch per model, whichever wrapper asked: step 0 only, no op trace, no injected fault."""
    fsdp2, accelerate = launch(tiny_lora_config("fsdp2")), launch(tiny_lora_config("accelerate"))
    assert fsdp2.key == accelerate.key == "lora-oracle-tiny-llama"
    assert (fsdp2.world_size, fsdp2.entry, fsdp2.inject) == (1, ENTRY, False)
    assert fsdp2.config["wrapper"] == "none" and fsdp2.config["steps"] == 1 and fsdp2.config["op_trace"] is False
    assert fsdp2.config["lora_r"] == 8 and fsdp2.config["target_modules"] == tiny_lora_config()["target_modules"]
    assert resolve_entry(ENTRY) is run


def test_the_oracle_records_step_0_of_the_adapter_in_float64(oracle: RunRecord) -> None:
    """Every adapter tensor's float64 gradient under the run's keys: lora_A's are zero (lora_B starts at zero),
    lora_B's are not; one loss; the mode it computed."""
    assert oracle.scenario == "lora-oracle" and oracle.world_size == 1
    assert len(oracle.param_names) == 28 and all(checks.is_adapter(n) for n in oracle.param_names)
    grads = {n: oracle.arrays[step0.FULL_PREFIX + n] for n in oracle.param_names}
    assert all(g.dtype == np.float64 for g in grads.values())
    assert all(not np.any(g) for n, g in grads.items() if "lora_A" in n)
    assert all(np.any(g) for n, g in grads.items() if "lora_B" in n)
    assert len(oracle.series["loss"]) == 1 and np.isfinite(oracle.series["loss"][0])
    assert oracle.results[MODE_KEY]["mode"]


def test_the_fp32_run_matches_the_oracle_and_another_seed_does_not(oracle: RunRecord, clean_lora_run: RunRecord,
                                                                   tmp_path: Path) -> None:
    """The oracle builds the model the run trains (same seeds, same batch): the run's step-0 loss and adapter
    gradients lie within fp32 rounding of it. An oracle of another seed is far off: the agreement is not vacuous."""
    def worst(exact: RunRecord) -> float:
        return max(float(np.max(np.abs(clean_lora_run.arrays[step0.FULL_PREFIX + n] - g)) / float(np.max(np.abs(g))))
                   for n in exact.param_names if "lora_B" in n
                   for g in [exact.arrays[step0.FULL_PREFIX + n]])

    assert clean_lora_run.series["loss"][0] == pytest.approx(oracle.series["loss"][0], rel=1e-6)
    assert worst(oracle) < 1e-4
    other = oracle_of(tmp_path, seed=1)
    assert other.series["loss"][0] != pytest.approx(oracle.series["loss"][0], rel=1e-4)
    assert worst(other) > 1e-1
