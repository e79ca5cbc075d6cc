"""Rank side: the one FSDP2 trainer build the training scenarios compose, and the trainer the loop drives.

A ``TrainingSpec`` names what differs as callables (as torchtitan's ModelSpec does); ``build`` composes them in
one order (docs/writing-a-scenario.md). Torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...training.data import token_source
from ...training.fsdp2 import describe_units, mixed_precision, reduce_dtype_of, shard, shard_units
from ...training.loop import Curves, TrainStep, clip_gradients, train
from ...training.models import blueprint
from ...training.optimizer import AdamWSettings, Optimization, Optimized, Schedule, adamw
from ...training.step import step_loss
from ..base import RankContext


def fully_sharded(model: Any, device: Any, mp_policy: Any, world_size: int,
                  reduce_dtype: str = "fp32") -> tuple[Any, dict[str, dict[str, Any]]]:
    """``model`` on ``device`` under ``fully_shard`` (each decoder layer, then the root), and its units as a record
    keeps them (training/fsdp2.py): described before wrapping, which replaces the parameters."""
    model = model.to(device)
    units = shard_units(model)
    table = describe_units(model, units, world_size, reduce_dtype)
    shard(units, mp_policy=mp_policy)
    return model, table


class Trainer(Optimized):
    """A trainer whose ``step`` is its scenario's training step: what the resume roles train (resume_roles.py)."""

    names: list[str]

    def step(self, ctx: RankContext, batch_of: Callable[[int], int] = int, **extra: Any) -> TrainStep:
        """The training step; step s reads batch ``batch_of(s)``. ``extra``: TrainStep's inspect and op_trace."""
        raise NotImplementedError

    def train(self, ctx: RankContext, steps: range, first_batch: int, progress: str,
              inspect: Callable[[int], None] | None = None) -> Curves:
        """``steps`` with the shared loop; step s reads batch ``first_batch + (s - steps.start)``."""
        step = self.step(ctx, lambda s: first_batch + s - steps.start, inspect=inspect)
        return train(ctx, step, steps, progress=progress)

    def weights(self) -> dict[str, np.ndarray]:
        """The whole trained tensors by name (collective: every rank gathers)."""
        return {name: p.detach().full_tensor().float().cpu().numpy() for name, p in zip(self.names, self.params)}


@dataclass
class FsdpTrainer(Trainer):
    """A module under FSDP2, AdamW over every parameter and its schedule, the data, the rank's place. Its step: the
    next-token loss of this rank's slice of the batch (training/step.py), every parameter clipped and tracked."""

    model: Any
    names: list[str]
    optimization: Optimization
    data: Any
    device: Any
    rank: int
    world_size: int
    units: dict[str, dict[str, Any]] = field(default_factory=dict)  # fully_sharded's table
    model_config: Any = None  # what the module was built from (training/models.py blueprint)

    def step(self, ctx: RankContext, batch_of: Callable[[int], int] = int, **extra: Any) -> TrainStep:
        params = self.params
        perturbation = str(ctx.config.get("perturbation", ""))  # set only in the noise replicas of a recording
        return TrainStep(loss=lambda s: step_loss(self.model, self.data, batch_of(s), ctx, perturbation, self.device),
                         optimization=self.optimization, clip=lambda: clip_gradients(params, float(ctx.config["grad_clip"])),
                         tracked=params, **extra)


@dataclass(frozen=True)
class TrainingSpec:
    """What a scenario's FSDP2 trainer is made of; ``build`` composes it."""

    model: Callable[[RankContext, dict[str, Any], Any], Any]  # (ctx, cfg, model config) -> the module on the CPU
    mp_policy: Callable[[dict[str, Any]], Any] = mixed_precision
    data: Callable[[dict[str, Any], int], Any] = token_source  # (cfg, vocab size)
    trainer: type[FsdpTrainer] = FsdpTrainer

    def build(self, ctx: RankContext, cfg: dict[str, Any] | None = None) -> FsdpTrainer:
        """A freshly initialised trainer of ``cfg`` (the launch's config by default) at step 0."""
        import torch

        cfg = ctx.config if cfg is None else cfg
        model_config, device = blueprint(cfg), torch.device(ctx.device)
        model, units = fully_sharded(self.model(ctx, cfg, model_config), device, self.mp_policy(cfg), ctx.world_size,
                                     reduce_dtype_of(cfg))
        named = list(model.named_parameters())
        optimization = Optimization.of(adamw([p for _, p in named], AdamWSettings.from_config(cfg)),
                                       Schedule.from_config(cfg))
        return self.trainer(model, [n for n, _ in named], optimization, self.data(cfg, model_config.vocab_size),
                            device, ctx.rank, ctx.world_size, units, model_config)
