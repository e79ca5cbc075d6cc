"""The lora scenario's float64 oracle, on one rank: step 0 of the adapter on the whole global batch in float64,
built as trainer.py builds the run's model (same seeds), its gradients under rank.py's keys. A recording stores its
distance from these, so re-recording over it is allowed only toward float64."""

from __future__ import annotations

from typing import Any

from ...evidence import step0
from ...evidence.oracle_step0 import MODE_KEY
from ...reference.record import RunRecord
from ..base import Launch
from ..shared.training_config import COMMON

ENTRY = "pytest_gpuregress.scenarios.lora.oracle:run"


def launch(config: dict[str, Any]) -> Launch:
    """The oracle of a model's lora ``config`` (no wrapper: float64 on one rank has none, so one oracle serves
    both of a model's cases): one rank, no faults (it is no stack under test)."""
    from ...evidence.op_trace import TRACE_CONFIG

    # "wrapper" names the launch's platform (LoraScenario.platform_tag): none here.
    return Launch(f"lora-oracle-{config.get('model', COMMON['model'])}",
                  {**config, "wrapper": "none", "steps": 1, TRACE_CONFIG: False}, world_size=1, entry=ENTRY, inject=False)


def run(ctx: Any) -> RunRecord:
    import torch

    from ...training.models import blueprint
    from ...training.oracle import float64_step0
    from . import adapter, checks
    from .trainer import build_base

    cfg = ctx.config
    model_config = blueprint(cfg)
    model = adapter.wrap_with_lora(build_base(cfg, model_config, ""), cfg)
    loss, mode = float64_step0(model, cfg, model_config.vocab_size)
    # An adapter the loss does not reach has no gradient: zero, as rank.py's AdamW sees it.
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters() if checks.is_adapter(n)}
    return RunRecord(scenario="lora-oracle", config=dict(cfg), platform_key="", world_size=1,
                     series={"loss": [loss]}, param_names=list(grads), results={MODE_KEY: mode},
                     arrays={step0.FULL_PREFIX + n: g.detach().numpy() for n, g in grads.items()})
