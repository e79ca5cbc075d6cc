"""The optimizer every training scenario shares: AdamW, with linear warm-up and cosine decay (schedule.py).

    settings = AdamWSettings.from_config(cfg)
    optimization = Optimization.of(adamw(params, settings), Schedule.from_config(cfg))
    ...                                  # forward, backward, clipping
    optimization.step()                  # the optimizer, the schedule, gradients cleared

Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schedule import lr_factor


@dataclass(frozen=True)
class AdamWSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    # False: the per-parameter loop, which every reference was recorded with; the multi-tensor path
    # (True, or None: torch's choice per device) rounds differently.
    foreach: bool | None = False

    @classmethod
    def from_config(cls, cfg: dict[str, Any], *, foreach: bool | None = False) -> AdamWSettings:
        """The settings of a scenario config's ``lr``, ``betas``, ``eps`` and ``weight_decay``."""
        beta1, beta2 = cfg["betas"]
        return cls(lr=float(cfg["lr"]), betas=(float(beta1), float(beta2)), eps=float(cfg["eps"]),
                   weight_decay=float(cfg["weight_decay"]), foreach=foreach)


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` of the rate at ``steps``."""

    steps: int
    warmup: int
    min_ratio: float

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Schedule:
        return cls(steps=int(cfg["steps"]), warmup=int(cfg["warmup_steps"]), min_ratio=float(cfg["min_lr_ratio"]))


def adamw(params: list[Any], settings: AdamWSettings) -> Any:
    """AdamW over ``params`` (a list: the caller decides which, e.g. only those that require a gradient)."""
    import torch

    return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                             weight_decay=settings.weight_decay, foreach=settings.foreach)


def warmup_cosine(optimizer: Any, schedule: Schedule) -> Any:
    """A LambdaLR stepping ``optimizer``'s rate along ``schedule``, once per optimizer step."""
    import torch

    steps, warmup, min_ratio = schedule.steps, schedule.warmup, schedule.min_ratio
    # A plain function, not a callable object: LambdaLR's state dict then holds no state of it (a checkpoint
    # saves the scheduler's state dict).
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
