"""A complete plug-in scenario: data-parallel least squares on every rank, compared with its reference.

Installed with its package (see pyproject.toml beside this file), it is one more scenario of
``pytest --gpuregress``: ``-k toy`` selects it, ``--gpuregress-record`` records it, and injected
faults reach it, with no line of plugin code changed.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import RankContext, Scenario, Setup


class ToyScenario(Scenario):
    name = "toy"
    rank_entry = "gpuregress_toy:train"  # what every rank runs

    def default_config(self, setup: Setup) -> dict[str, Any]:
        # Stored with the reference: a reference recorded with another config is refused as foreign.
        return {"steps": setup.steps or 20, "lr": 0.1, "dtype": "fp32"}


SCENARIO = ToyScenario()


def train(ctx: RankContext) -> RunRecord:
    """Runs on every rank inside the process group; torch is imported here, not at collection."""
    import torch
    import torch.distributed as dist

    weights = torch.zeros(4, requires_grad=True)
    losses = []
    for step in range(ctx.config["steps"]):
        inputs = torch.arange(8.0).reshape(2, 4) / 8 + ctx.rank  # each rank has its own data
        loss = (inputs @ weights - 1).pow(2).mean()
        loss.backward()
        dist.all_reduce(weights.grad)  # data parallel: average the gradients
        with torch.no_grad():
            weights -= ctx.config["lr"] * weights.grad / ctx.world_size
            weights.grad.zero_()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / ctx.world_size)
        ctx.step_done(step)  # progress for hang reports; injected step faults fire here
    return RunRecord(scenario="toy", config=dict(ctx.config), platform_key="", world_size=ctx.world_size,
                     series={"loss": losses})
