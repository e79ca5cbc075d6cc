"""A matmul that is one ulp off: one device with a failing part or a bad flag, as small as a fault can be.

After ``after`` untouched calls, the first element of every floating output of matmul, mm, bmm and linear
moves one ulp away from zero: only a bitwise comparison (the consensus vote) can see it.
"""

from __future__ import annotations

from typing import Any

from ..training.kernels import fault_region
from . import FaultSpec
from .fired import Firing, patch

WRAPPED = (("torch", "matmul"), ("torch", "mm"), ("torch", "bmm"), ("torch.nn.functional", "linear"))
_SAME_WIDTH_INT = {2: "int16", 4: "int32", 8: "int64"}


def one_ulp_away_from_zero(out: Any) -> bool:
    """Move ``out``'s first element one ulp away from zero, in place; False where there is nothing to move."""
    import torch

    if not out.is_floating_point() or out.numel() == 0 or out.element_size() not in _SAME_WIDTH_INT:
        return False
    first = (0,) * out.dim()
    with torch.no_grad():
        held = out.detach()  # same storage: the change reaches the caller, and autograd records no op of ours
        value = held[first].clone().reshape(1)
        if not bool(torch.isfinite(value).all()):
            return False
        as_int = value.view(getattr(torch, _SAME_WIDTH_INT[out.element_size()]))
        held[first] = (as_int + 1).view(out.dtype)[0]
    return True


def install_matmul_ulp(spec: FaultSpec, ctx: Any) -> Firing:
    import importlib

    firing = Firing(spec.text)  # outputs moved
    skip = int(spec.get("after", 0))
    calls = [0]

    def wrap(original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            calls[0] += 1
            if calls[0] > skip:
                with fault_region():  # the fault's own arithmetic is not a kernel of the stack
                    if one_ulp_away_from_zero(out):
                        firing.fire()
            return out

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    for module_name, name in WRAPPED:
        patch(ctx, importlib.import_module(module_name), name, wrap)
    return firing
