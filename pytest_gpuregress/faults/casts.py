"""A conversion kernel that rounds wrongly: fp32 (and fp64) -> bf16 casts that cut toward zero (``truncate_bf16``).

Wraps ``Tensor.to`` and ``Tensor.bfloat16``, where FSDP2 mixed precision casts: the real conversion runs and
its output is overwritten in place, so the op trace sees the same ``aten::_to_copy`` a broken build would run.
"""

from __future__ import annotations

from typing import Any

from ..training.kernels import fault_region
from . import FaultSpec
from .fired import Firing, patch

WRAPPED = ("to", "bfloat16")
LOW_HALF = 0xFFFF0000 - (1 << 32)  # as a signed int32: keeps sign, exponent and the top 7 mantissa bits


def truncated_bf16(values: Any) -> Any:
    """fp32 ``values`` cast to bf16 toward zero: the bf16 whose bits are the top half of each fp32 (exact)."""
    import torch

    kept = values.contiguous().view(torch.int32) & LOW_HALF
    return kept.view(torch.float32).to(torch.bfloat16)


def install_cast(spec: FaultSpec, ctx: Any) -> Firing:
    import torch

    firing = Firing(spec.text)  # conversions whose result changed
    busy = [False]  # the fault's own conversions below go through these methods too

    def wrap(original: Any) -> Any:
        def converted(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if busy[0]:
                return out
            if (isinstance(out, torch.Tensor) and out is not self and self.dtype in (torch.float32, torch.float64)
                    and out.dtype == torch.bfloat16 and out.numel() and not is_traceable_wrapper_subclass(out)):
                busy[0] = True
                try:
                    with fault_region(), torch.no_grad():
                        cut = truncated_bf16(self.detach().to(out.device, torch.float32)).reshape(out.shape)
                        if not torch.equal(cut, out.detach()):
                            out.detach().copy_(cut)  # in place: the op's own output, as the op trace digests it
                            firing.fire()
                finally:
                    busy[0] = False
            return out

        converted.__wrapped__ = original  # type: ignore[attr-defined]
        return converted

    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for name in WRAPPED:
        patch(ctx, torch.Tensor, name, wrap)
    return firing
