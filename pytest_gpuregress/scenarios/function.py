"""A user's own training function as a scenario: ``get_scenario("module:function")`` (recorder.py records it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import Launch, Scenario, Setup
from .shared.replicas import perturbed_launches


@dataclass
class FunctionScenario(Scenario):
    """A user's own ``def train(ctx: RankContext) -> RunRecord``, found by "module:function"."""

    entry: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property  # type: ignore[override]
    def name(self) -> str:  # noqa: D401 - the function's name
        return self.entry.rsplit(":", 1)[-1]

    @property  # type: ignore[override]
    def rank_entry(self) -> str:
        return self.entry

    def default_config(self, setup: Setup) -> dict[str, Any]:
        config = super().default_config(setup)
        config.update(self.config)
        return config

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        """The built-in scenarios' replicas: the kernel path needs nothing of the user's code; the weights and
        the batch order are perturbed where its Recorder is given the model and the batches (recorder.py)."""
        return perturbed_launches(launch, setup, count)
