"""Kernel and throughput faults, installed on a rank: what an upgrade does when a fused kernel goes missing.

sdpa_backend: another SDPA backend; host_op: an op falls back to the CPU (on a CPU-only build emulated by a
device tag: training/kernels.py); slow_step: the optimizer step sleeps, which the throughput ratio must show.
"""

from __future__ import annotations

import time
from typing import Any

from . import FaultSpec
from .fired import Firing, patch

SDPA_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
HOST_OPS = ("silu",)


def install_sdpa_backend(spec: FaultSpec, ctx: Any) -> Firing:
    """Every F.scaled_dot_product_attention call runs under ``sdpa_kernel(backend)``: per call, because the
    rank resets the global backend switches after faults are installed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[spec.get("backend", "math")])
    firing = Firing(spec.text)  # attention calls forced onto the backend

    def wrap(original: Any) -> Any:
        def forced(*args: Any, **kwargs: Any) -> Any:
            firing.fire()
            with sdpa_kernel(backend):
                return original(*args, **kwargs)
        return forced

    patch(ctx, F, "scaled_dot_product_attention", wrap)
    return firing


def install_host_op(spec: FaultSpec, ctx: Any) -> Firing:
    """F.silu (the MLP's activation) computed on the host and copied back."""
    import torch.nn.functional as F

    from ..training.kernels import emulated_accelerator, host_fallback, set_emulated_accelerator

    original = F.silu
    firing = Firing(spec.text)  # calls moved to the host

    def silu_on_host(input: Any, inplace: bool = False) -> Any:
        firing.fire()
        with host_fallback():
            result = original(input.to("cpu"), inplace=False).to(input.device)
        return input.copy_(result) if inplace else result  # an in-place call must still change its input

    previous = emulated_accelerator()
    if ctx.device_kind == "cpu":
        set_emulated_accelerator("cuda (emulated by a device tag)")
    F.silu = silu_on_host
    ctx.cleanup_hooks.append(lambda: setattr(F, "silu", original))
    ctx.cleanup_hooks.append(lambda: set_emulated_accelerator(previous))
    return firing


def install_slow_step(spec: FaultSpec, ctx: Any) -> Firing:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seconds = float(spec.get("seconds", 0.2))
    firing = Firing(spec.text)  # optimizer steps slowed

    def sleep(optimizer: Any, args: Any, kwargs: Any) -> None:
        firing.fire()
        time.sleep(seconds)

    ctx.cleanup_hooks.append(register_optimizer_step_pre_hook(sleep).remove)
    return firing
