"""Training-level faults, installed on a rank: a changed learning rate, and kernel drift."""

from __future__ import annotations

from typing import Any

from . import FaultSpec


def install_lr_scale(spec: FaultSpec, ctx: Any) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    factor = spec.get("factor", 1.01)
    saved: dict[int, list[float]] = {}

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        saved[id(optimizer)] = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, saved.pop(id(optimizer), [])):
            group["lr"] = lr

    ctx.cleanup_hooks.append(register_optimizer_step_pre_hook(pre).remove)
    ctx.cleanup_hooks.append(register_optimizer_step_post_hook(post).remove)


def install_linear_noise(spec: FaultSpec, ctx: Any) -> None:
    import torch.nn.functional as F

    rel = spec.get("rel", 1e-7)
    original = F.linear

    def linear(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs) * (1 + rel)

    F.linear = linear
    ctx.cleanup_hooks.append(lambda: setattr(F, "linear", original))
