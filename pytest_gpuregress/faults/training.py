"""Training-level faults, installed on a rank: a changed learning rate, and kernel drift."""

from __future__ import annotations

from typing import Any

from ..evidence.clipping import TORCH_EPS
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
    """Every F.linear output x (1 + rel x s[j]), s a fixed +-1 pattern over output features, written in place.

    Per-feature, because kernel drift differs per column and RMSNorm would divide a uniform scale back out;
    independent of the batch, so every world size sees the same kernel. ``rows``/``features`` restrict it
    to GEMMs of that shape."""
    import torch
    import torch.nn.functional as F

    rel = spec.get("rel", 1e-7)
    rows, features = spec.get("rows"), spec.get("features")  # None: every shape
    last_only = spec.get("elements", "all") == "last"
    original = F.linear
    patterns: dict[tuple[int, str, Any], Any] = {}
    firing = Firing(spec.text)  # linear outputs changed

    def linear(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if (rows is not None and out.numel() // max(out.shape[-1], 1) != rows) or \
                (features is not None and out.shape[-1] != features):
            return out  # another shape: another kernel, which is right
        key = (out.shape[-1], str(out.device), out.dtype)
        if last_only:  # one wrong element, written through memory as a faulty kernel's store would be
            with fault_region(), torch.no_grad():
                flat = out.detach().view(-1)
                flat[-1:] *= 1 + rel
            firing.fire()
            return out
        with fault_region():  # the emulated drift's own arithmetic is not a kernel of the stack
            if key not in patterns:
                feature = torch.arange(out.shape[-1], device=out.device, dtype=torch.int64)
                sign = 1 - 2 * ((feature * 2654435761) % 4294967296 >= 2147483648).to(torch.float64)
                pattern = (1.0 + rel * sign).to(out.dtype)
                # In bf16 a 1e-7 drift rounds to exactly 1: such a fault changes nothing and must not count.
                patterns[key] = pattern if bool((pattern != 1).any()) else None
            if patterns[key] is None:
                return out
            with torch.no_grad():  # through memory, as a kernel writes its output: no op of autograd's
                out.detach().mul_(patterns[key])
            firing.fire()
            return out

    F.linear = linear
    ctx.cleanup_hooks.append(lambda: setattr(F, "linear", original))
    return firing


def install_clip(spec: FaultSpec, ctx: Any) -> Firing:
    """Gradient clipping gone wrong where it acts: ``scale`` leaves the clipped gradients x (1 + rel) (a clip
    coefficient off by rel), ``skip`` returns the norm and clips nothing. Through ``torch.nn.utils.clip_grad_norm_``,
    which both the plugin's loop and accelerate's ``clip_grad_norm_`` call; counted on the steps where it clipped."""
    import torch
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    mode, rel = spec.get("mode", "scale"), float(spec.get("rel", 1e-3))
    original = clip_grad.clip_grad_norm_
    firing = Firing(spec.text)  # steps whose clipping went wrong

    def clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total = original(params, float("inf") if mode == "skip" else max_norm, *args, **kwargs)
        whole = total.full_tensor() if hasattr(total, "full_tensor") else total
        if float(whole) + TORCH_EPS > max_norm:  # torch's own test: a coefficient below one
            firing.fire()
            if mode == "scale":
                with fault_region(), torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(1.0 + rel)
        return total

    for module in (nn_utils, clip_grad):
        module.clip_grad_norm_ = clip
    ctx.cleanup_hooks.append(lambda: [setattr(m, "clip_grad_norm_", original) for m in (nn_utils, clip_grad)])
    return firing


def install_adamw(spec: FaultSpec, ctx: Any) -> Firing:
    """One AdamW implementation (``mode``: single, foreach or fused) steps with lr x factor; the others are right.
    A bug that lives in one path only, as torch's fused and foreach kernels are separate code."""
    import torch.optim.adam as adam

    function = {"single": "_single_tensor_adam", "foreach": "_multi_tensor_adam", "fused": "_fused_adam"}[spec.get("mode")]
    factor = float(spec.get("factor", 1.001))
    original = getattr(adam, function)
    firing = Firing(spec.text)  # optimizer steps through that implementation

    def wrong_rate(*args: Any, **kwargs: Any) -> Any:
        firing.fire()
        kwargs["lr"] = kwargs["lr"] * factor
        return original(*args, **kwargs)

    setattr(adam, function, wrong_rate)
    ctx.cleanup_hooks.append(lambda: setattr(adam, function, original))
    return firing
