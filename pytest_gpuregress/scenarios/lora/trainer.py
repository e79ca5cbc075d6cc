"""Rank side: the lora run's model and trainer, built one way for the run and the resume roles, so a continuation
trains exactly what the reference trained: ``adapted``, the peft model before distribution (what the LoRA checks
read), then ``distribute``, a ``LoraTrainer`` in its wrapper (wrappers.py). Torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...training.optimizer import Optimization, Schedule
from ..base import RankContext
from ..shared.trainer import Trainer
from . import adapter, adapter_io, checks, wrappers

if TYPE_CHECKING:
    from ...training.loop import TrainStep


def build_base(cfg: dict[str, Any], model_config: Any, perturbation: str) -> Any:
    from ...training.models import build_causal_lm
    from ...training.noise import apply_weight_perturbation

    base = build_causal_lm(model_config, seed=int(cfg["seed"]))
    apply_weight_perturbation(base, perturbation, cfg["dtype"])  # a noise replica's base, rebuilt identically on reload
    return base


@dataclass
class Adapted:
    """The peft model before it is distributed, and what built it."""

    peft_model: Any
    targeted: list[str]  # the base's linear layers the adapter targets (adapter.targeted_modules)
    model_config: Any
    perturbation: str  # set only in the noise replicas of a recording


def adapted(ctx: RankContext) -> Adapted:
    """The base model with the adapter on it, on the CPU; the kernel path and switches of the config applied."""
    from ...training.models import blueprint
    from ...training.noise import apply_kernel_path, apply_switches
    from ...training.projections import is_parameter_wrapper, matches

    cfg = ctx.config
    model_config = blueprint(cfg)
    perturbation = str(cfg.get("perturbation", ""))
    apply_kernel_path(perturbation, ctx)
    apply_switches(cfg, ctx)
    base = build_base(cfg, model_config, perturbation)
    targeted = adapter.targeted_modules(base, list(cfg["target_modules"]))
    model = adapter.wrap_with_lora(base, cfg)
    kept = adapter.module_targets(model)
    if kept is not None:  # peft moved some targets onto fused expert parameters: those names adapt no module now,
        # and the parameter wrappers it made in their place carry adapters the checks must see
        targeted = [name for name in targeted if any(matches(t, name) for t in kept)]
        targeted += [name for name, module in model.base_model.model.named_modules() if is_parameter_wrapper(module)]
    return Adapted(model, targeted, model_config, perturbation)


@dataclass
class LoraTrainer(Trainer):
    """The peft model in its wrapper, the adapter's parameters by name, AdamW and the schedule, and the data (the
    batch of step s is batch s)."""

    wrapped: wrappers.Wrapped
    names: list[str]  # the adapter's parameters, as the record names them
    optimization: Optimization  # over the optimizer the wrapper hands out (accelerate's own there)
    data: Any
    perturbation: str

    @property
    def model(self) -> Any:
        """The PeftModel: what DCP's state dicts read and fill (through a DDP wrapper they would read the same)."""
        return self.wrapped.peft_model

    @property
    def optimizer(self) -> Any:
        return self.wrapped.torch_optimizer  # DCP initialises and fills a torch optimizer, not accelerate's wrapper

    @property
    def frozen(self) -> list[tuple[str, Any]]:
        """The base weights by name: saved and loaded with the adapter, never trained (state_digests.boundary)."""
        adapter = set(self.names)
        return [(n, p) for n, p in self.wrapped.peft_model.named_parameters() if n not in adapter]

    @property
    def params(self) -> list[Any]:
        """The adapter's parameters in ``names``' order, whose gradient norms the record keeps (not whatever requires a
        gradient: a base weight a broken peft left trainable must not shift the pairs)."""
        named = dict(self.wrapped.peft_model.named_parameters())
        return [named[n] for n in self.names]

    def step(self, ctx: RankContext, batch_of: Callable[[int], int] = int, **extra: Any) -> TrainStep:
        """The training step; step s reads batch ``batch_of(s)``. ``extra``: TrainStep's inspect and op_trace."""
        import torch

        from ...training.loop import TrainStep
        from ...training.step import next_token_loss, rank_tokens

        device = torch.device(ctx.device)
        wrapped = self.wrapped
        return TrainStep(
            loss=lambda s: next_token_loss(wrapped.model, rank_tokens(self.data, batch_of(s), ctx, self.perturbation,
                                                                   device)),
            # The scheduler is ours under both wrappers, over the optimizer the wrapper hands out.
            optimization=self.optimization,
            clip=lambda: wrapped.clip(float(ctx.config["grad_clip"])),
            backward=wrapped.backward,
            tracked=self.params,  # the adapters only; the optimizer and the clipping take whatever requires a gradient
            **extra,
        )

    def weights(self) -> dict[str, np.ndarray]:
        return {n: adapter_io.to_numpy(p) for n, p in zip(self.names, self.params)}  # every rank's slice, gathered


def distribute(ctx: RankContext, model: Adapted) -> LoraTrainer:
    """``model`` in the config's wrapper, with its optimizer, schedule and data."""
    from ...training.data import token_source

    cfg = ctx.config
    wrapped = wrappers.build(model.peft_model, cfg, ctx.device_kind, ctx.world_size)
    names = [n for n, _ in wrapped.peft_model.named_parameters() if checks.is_adapter(n)]
    return LoraTrainer(wrapped, names, Optimization.of(wrapped.optimizer, Schedule.from_config(cfg)),
                       token_source(cfg, model.model_config.vocab_size), model.perturbation)


def build(ctx: RankContext) -> LoraTrainer:
    """The trainer rank.py trains, at step 0."""
    return distribute(ctx, adapted(ctx))
