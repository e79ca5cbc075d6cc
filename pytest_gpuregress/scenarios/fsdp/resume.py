"""The fsdp scenario's resume from its reference, on one rank: its trainer for the save and continue roles
(shared/resume_roles.py, which says what each role does).

The model, optimizer, data and step are rank.py's (a noise replica's perturbation aside): on the
recording stack the continuation repeats the reference's last steps bit for bit, which the e2e test checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...reference.record import RunRecord
from ...training.optimizer import AdamWSettings, Optimization, Optimized, Schedule, adamw
from ..base import RankContext
from ..shared.resume_roles import Roles

if TYPE_CHECKING:
    from ...training.loop import Curves

ENTRY = "pytest_gpuregress.scenarios.fsdp.resume:run"


@dataclass
class FsdpTrainer(Optimized):
    """rank.py's model under FSDP2, its AdamW and schedule, and its data (the batch of step s is batch s)."""

    model: Any
    names: list[str]
    optimization: Optimization
    data: Any

    def train(self, ctx: RankContext, steps: range, first_batch: int, progress: str,
              inspect: Callable[[int], None] | None = None) -> Curves:
        import torch

        from ...training.loop import TrainStep, clip_gradients, train
        from ...training.step import next_token_loss, rank_tokens

        device = torch.device(ctx.device)
        params = self.params
        perturbation = str(ctx.config.get("perturbation", ""))  # a noise replica of the late gradients (recording)
        step = TrainStep(
            loss=lambda s: next_token_loss(self.model, rank_tokens(self.data, first_batch + s - steps.start, ctx,
                                                                   perturbation, device)),
            optimization=self.optimization,
            clip=lambda: clip_gradients(params, float(ctx.config["grad_clip"])),
            tracked=params,
            inspect=inspect,
        )
        return train(ctx, step, steps, progress=progress)

    def weights(self) -> dict[str, np.ndarray]:
        return {name: p.detach().full_tensor().float().cpu().numpy() for name, p in zip(self.names, self.params)}


def build(ctx: RankContext) -> FsdpTrainer:
    """The trainer rank.py builds, at step 0."""
    import torch

    from ...training.data import token_source
    from ...training.fsdp2 import mixed_precision, shard, shard_units
    from ...training.models import blueprint, build_causal_lm
    from ...training.noise import apply_kernel_path
    from ...training.switches import apply_switches

    cfg = ctx.config
    model_config = blueprint(cfg)
    model = build_causal_lm(model_config, seed=int(cfg["seed"]))
    apply_kernel_path(str(cfg.get("perturbation", "")), ctx)  # GPUs; a CPU replica's kernel path is its environment
    apply_switches(cfg, ctx)
    model = model.to(torch.device(ctx.device))
    shard(shard_units(model), mp_policy=mixed_precision(cfg))
    named = list(model.named_parameters())
    optimization = Optimization.of(adamw([p for _, p in named], AdamWSettings.from_config(cfg)),
                                   Schedule.from_config(cfg))
    return FsdpTrainer(model, [n for n, _ in named], optimization, token_source(cfg, model_config.vocab_size))


ROLES = Roles("fsdp", build)


def run(ctx: RankContext) -> RunRecord:
    return ROLES.run(ctx)
