"""Training-level faults, installed on a rank: a changed learning rate, and kernel drift."""

from __future__ import annotations

from typing import Any

from ..training.kernels import fault_region
from . import FaultSpec
from .firing import Firing


def install_lr_scale(spec: FaultSpec, ctx: Any) -> Firing:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    factor = spec.get("factor", 1.01)
    saved: dict[int, list[float]] = {}
    firing = Firing(spec.text)  # optimizer steps taken at the changed rate

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        saved[id(optimizer)] = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        firing.fire()

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, saved.pop(id(optimizer), [])):
            group["lr"] = lr

    ctx.cleanup_hooks.append(register_optimizer_step_pre_hook(pre).remove)
    ctx.cleanup_hooks.append(register_optimizer_step_post_hook(post).remove)
    return firing


def install_linear_noise(spec: FaultSpec, ctx: Any) -> Firing:
    """Every F.linear output x (1 + rel x s[j]), s a fixed +-1 pattern over the output features j.

    Kernel drift differs per output (another summation order rounds each column differently); a
    uniform scale would be the wrong emulation, since RMSNorm divides it right back out. The
    pattern depends on the feature only, not on the batch, so every world size sees the same kernel."""
    import torch
    import torch.nn.functional as F

    rel = spec.get("rel", 1e-7)
    original = F.linear
    patterns: dict[tuple[int, str, Any], Any] = {}
    firing = Firing(spec.text)  # linear outputs changed

    def linear(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        key = (out.shape[-1], str(out.device), out.dtype)
        with fault_region():  # the emulated drift's own arithmetic is not a kernel of the stack
            if key not in patterns:
                feature = torch.arange(out.shape[-1], device=out.device, dtype=torch.int64)
                sign = 1 - 2 * ((feature * 2654435761) % 4294967296 >= 2147483648).to(torch.float64)
                pattern = (1.0 + rel * sign).to(out.dtype)
                # In bf16 a 1e-7 drift rounds to exactly 1: such a fault changes nothing and must not count.
                patterns[key] = pattern if bool((pattern != 1).any()) else None
            if patterns[key] is None:
                return out
            firing.fire()
            return out * patterns[key]

    F.linear = linear
    ctx.cleanup_hooks.append(lambda: setattr(F, "linear", original))
    return firing
