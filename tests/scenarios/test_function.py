"""A user's own training function as a scenario (scenarios/function.py): found by "module:function", named after the
function, launched at it, its config the session's under the user's own, and its noise replicas perturbed runs of
the same function whose Recorder applies the perturbation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress import Recorder
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import get_scenario, resolve_entry
from pytest_gpuregress.scenarios.base import Launch, RankContext, Setup
from pytest_gpuregress.scenarios.function import FunctionScenario
from pytest_gpuregress.training.noise import PERTURBATIONS, lower_cpu_capability

ENTRY = f"{__name__}:train_tiny"
CPU = Setup(device_kind="cpu", backend="gloo", world_size=1, steps=7)


def train_tiny(ctx: RankContext) -> RunRecord:
    """A user's training function: a linear model fitted by SGD, its losses handed to a Recorder given the model
    and the batches (so a replica's perturbation reaches both)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    recorder = Recorder(ctx, "train_tiny", model)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(ctx.config["lr"]))
    data = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(int(ctx.config["steps"])):
        rows = recorder.batch(data)
        loss = (model(rows[:, :4]).squeeze(1) - rows[:, 4]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        recorder.step(loss)
    return recorder.record()


def trained(launch: Launch, tmp_path: Path) -> list[float]:
    """The losses the scenario's rank entry records for ``launch`` at one CPU rank."""
    sc = get_scenario(ENTRY)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device_kind="cpu", backend="gloo", config=launch.config,
                      run_dir=tmp_path, profile=False)
    return resolve_entry(sc.rank_entry)(ctx).series["loss"]


def test_a_user_function_is_a_scenario_named_after_it() -> None:
    """get_scenario("module:function") gives a FunctionScenario whose ranks run that function."""
    sc = get_scenario(ENTRY)
    assert isinstance(sc, FunctionScenario)
    assert (sc.name, sc.rank_entry) == ("train_tiny", ENTRY)
    assert resolve_entry(sc.rank_entry) is train_tiny


def test_its_config_is_the_sessions_under_the_users_own() -> None:
    """The steps asked of the session, unless the user's config names its own; the rest of the user's as given."""
    assert FunctionScenario(entry=ENTRY).default_config(CPU) == {"steps": 7}
    assert FunctionScenario(entry=ENTRY, config={"lr": 0.1}).default_config(CPU) == {"steps": 7, "lr": 0.1}
    assert FunctionScenario(entry=ENTRY, config={"steps": 2}).default_config(CPU) == {"steps": 2}


def test_its_noise_replicas_are_the_launch_perturbed(tmp_path: Path) -> None:
    """One launch per perturbation, the launch's config and environment kept; another kernel path is asked of ATen
    where this CPU has a lower one."""
    launch = Launch("main", {"steps": 3, "lr": 0.05}, env={"USER_VAR": "1"})
    replicas = FunctionScenario(entry=ENTRY).noise_replicas(launch, CPU, 3)
    assert [r.key for r in replicas] == [f"replica-{p}" for p in PERTURBATIONS[:3]]
    assert [r.config for r in replicas] == [{"steps": 3, "lr": 0.05, "perturbation": p} for p in PERTURBATIONS[:3]]
    lower = lower_cpu_capability()
    kernel_path = {"USER_VAR": "1", **({"ATEN_CPU_CAPABILITY": lower} if lower else {})}
    assert [r.env for r in replicas] == [{"USER_VAR": "1"}, {"USER_VAR": "1"}, kernel_path]


@pytest.mark.parametrize("perturbation", ["weights_ulp_up", "reduction_order"])
def test_a_replica_runs_the_same_function_a_rounding_away(tmp_path: Path, perturbation: str) -> None:
    """The user's function under a replica's config trains nearly the same losses, yet not bit for bit: the
    Recorder applied the perturbation (weights one ulp up, the batch's rows reversed)."""
    launch = Launch("main", FunctionScenario(entry=ENTRY, config={"lr": 0.05}).default_config(CPU))
    (replica,) = [r for r in FunctionScenario(entry=ENTRY).noise_replicas(launch, CPU, 2)
                  if r.config["perturbation"] == perturbation]
    plain, perturbed = trained(launch, tmp_path), trained(replica, tmp_path)
    assert len(plain) == len(perturbed) == 7
    assert plain != perturbed
    np.testing.assert_allclose(perturbed, plain, rtol=1e-5)

