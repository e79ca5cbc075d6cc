"""The optimizer every training scenario shares: AdamW, with linear warm-up and cosine decay (``lr_factor``).

    settings = AdamWSettings.from_config(cfg)
    optimization = Optimization.of(adamw(params, settings), Schedule.from_config(cfg))
    ...                                  # forward, backward, clipping
    optimization.step()                  # the optimizer, the schedule, gradients cleared

Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

# torch's three AdamW implementations, as a config names them (``adamw``): each rounds differently, and a bug can
# live in one only. "single": the per-parameter loop; "foreach": the multi-tensor path, torch's default on GPUs;
# "fused": one fused kernel (torch._fused_adamw_), the HF Trainer's and torchtitan's default.
Implementation = Literal["single", "foreach", "fused"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("single", "foreach", "fused")


@dataclass(frozen=True)
class AdamWSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    implementation: Implementation = "single"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AdamWSettings:
        """The settings of a scenario config's ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``adamw`` (the
        implementation; a user's config without it runs the single-tensor loop)."""
        beta1, beta2 = cfg["betas"]
        implementation = str(cfg.get("adamw", "single"))
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"config adamw={implementation!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
        return cls(lr=float(cfg["lr"]), betas=(float(beta1), float(beta2)), eps=float(cfg["eps"]),
                   weight_decay=float(cfg["weight_decay"]), implementation=implementation)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` of the rate at ``steps``."""

    steps: int
    warmup: int
    min_ratio: float

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Schedule:
        return cls(steps=int(cfg["steps"]), warmup=int(cfg["warmup_steps"]), min_ratio=float(cfg["min_lr_ratio"]))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def adamw(params: list[Any], settings: AdamWSettings) -> Any:
    """AdamW over ``params`` (a list: the caller decides which, e.g. only those that require a gradient)."""
    import torch

    chosen = settings.implementation
    return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                             weight_decay=settings.weight_decay, foreach=chosen == "foreach",
                             fused=True if chosen == "fused" else None)


def warmup_cosine(optimizer: Any, schedule: Schedule) -> Any:
    """A LambdaLR stepping ``optimizer``'s rate along ``schedule``, once per optimizer step."""
    import torch

    steps, warmup, min_ratio = schedule.steps, schedule.warmup, schedule.min_ratio
    # A plain function, not a callable object: LambdaLR's state dict (which checkpoints save) then holds none of it.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup, min_ratio))


@dataclass
class Optimization:
    """An optimizer and its learning-rate schedule, stepped together."""

    optimizer: Any
    scheduler: Any

    @classmethod
    def of(cls, optimizer: Any, schedule: Schedule) -> Optimization:
        return cls(optimizer, warmup_cosine(optimizer, schedule))

    def step(self) -> None:
        """One optimizer step, one schedule step, and the gradients dropped (set to None, not zeroed)."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


class Optimized:
    """A trainer's view of the ``Optimization`` it holds: its optimizer, its schedule and the parameters it steps
    (what checkpoints save and state digests read)."""

    optimization: Optimization

    @property
    def optimizer(self) -> Any:
        return self.optimization.optimizer

    @property
    def scheduler(self) -> Any:
        return self.optimization.scheduler

    @property
    def params(self) -> list[Any]:
        return list(self.optimizer.param_groups[0]["params"])
