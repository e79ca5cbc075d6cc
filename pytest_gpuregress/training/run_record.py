"""The record a built-in training run hands back: one assembly for the fsdp and lora ranks. Torch-free."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..reference.record import RunRecord
from .loop import Curves, TrainStep
from .observe import StepObserver
from .op_trace import stored


def training_record(scenario: str, ctx: Any, step: TrainStep, curves: Curves, observer: StepObserver,
                    names: list[str], step0: dict[str, np.ndarray], digests: dict[str, Any],
                    results: dict[str, Any]) -> RunRecord:
    """``results`` gets the observer's results and step 0's op trace (op_trace.py) besides the scenario's own."""
    results.update(observer.results())
    results.update(curves.collectives)
    traced = stored(step.op_trace, results)
    return RunRecord(
        scenario=scenario,
        config=dict(ctx.config),
        platform_key="",  # set by the plugin, which knows the platform
        world_size=ctx.world_size,
        series=curves.series(),
        param_names=names,
        arrays={"param_grad_norm": curves.param_norms(len(step.tracked)), **step0, **traced},
        digests=digests,
        results=results,
        timings=observer.timings(),
    )
