"""The FSDP2 wrapping every training scenario shares: ``fully_shard`` on each unit, in order.

The units come from shard_units.py (each decoder layer, then the root), so the wrapping and the
failure report's account of which reduce-scatter carries a gradient never disagree.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def mixed_precision(dtype: str) -> Any:
    """The policy of a scenario's compute dtype: bf16 parameters with fp32 gradient reduction for "bf16";
    None for anything else, which means the wrapper's own default (fp32 throughout)."""
    if dtype != "bf16":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # The reduce dtype stays fp32 on every platform: shard_units.REDUCE_BYTES counts on it.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(units: Sequence[tuple[str, Any]], *, mp_policy: Any = None,
          reshard_after_forward: bool | None = None) -> None:
    """``fully_shard`` every (path, module) of ``units``, in order: the root must come last.

    ``mp_policy``: a MixedPrecisionPolicy (``mixed_precision``), None for fp32 throughout.
    ``reshard_after_forward``: as fully_shard takes it; None is torch's default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for _path, module in units:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
