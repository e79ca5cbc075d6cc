"""Which ranks a run has: spawned locally, in place under torchrun, or in place under srun."""

from __future__ import annotations

import pytest

from pytest_gpuregress.errors import UnsupportedPlatform
from pytest_gpuregress.stack.platforms import adopt_srun_environment

SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
             "MASTER_ADDR": "node001", "MASTER_PORT": "29500"}


def test_an_srun_task_becomes_the_rank_slurm_gave_it() -> None:
    env = dict(SRUN_TASK)
    adopt_srun_environment(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")


def test_srun_without_a_rendezvous_address_names_the_variables_to_set() -> None:
    env = {k: v for k, v in SRUN_TASK.items() if k != "MASTER_ADDR"}
    with pytest.raises(UnsupportedPlatform, match="MASTER_ADDR must be set"):
        adopt_srun_environment(env)


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"},  # the batch script of an allocation: not a job step
    {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"},  # srun with one task: spawn ranks as usual
    {**SRUN_TASK, "RANK": "2", "WORLD_SIZE": "4"},  # torchrun inside srun: torchrun's variables win
    {**SRUN_TASK, "GPUREGRESS_SPAWNED": "1"},  # a rank this plugin spawned
], ids=["batch-script", "one-task", "torchrun-inside", "spawned-rank"])
def test_outside_a_multi_task_srun_step_nothing_changes(env: dict[str, str]) -> None:
    before = dict(env)
    adopt_srun_environment(env)
    assert env == before


def test_an_srun_task_bound_to_one_gpu_uses_device_zero_and_knows_its_node_size() -> None:
    env = {**SRUN_TASK, "CUDA_VISIBLE_DEVICES": "3", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    adopt_srun_environment(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "0", "4")
