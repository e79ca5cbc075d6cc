"""The FSDP2 wrapping every training scenario shares: ``fully_shard`` on each unit of shard_units.py, in order.

One source of units, so the wrapping and the failure report's reduce-scatter account never disagree.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REDUCE_DTYPE = "reduce_dtype"  # config key: the gradient reduce-scatter's dtype under bf16 ("fp32" when absent)


def reduce_dtype_of(config: dict[str, Any]) -> str:
    """The dtype a run's gradients are reduce-scattered in: bf16 only where a bf16 run's config says so."""
    return str(config.get(REDUCE_DTYPE, "fp32")) if config.get("dtype") == "bf16" else "fp32"


def mixed_precision(config: dict[str, Any]) -> Any:
    """The policy of a run's compute dtype: bf16 parameters for "bf16", with gradients reduced in fp32 (GPUs,
    torchtitan's default) or in bf16 where the config's ``reduce_dtype`` says so (the CPU bf16 lane: FSDP2's own
    default when only ``param_dtype`` is set, which many users run). None for anything else: fp32 throughout."""
    if config.get("dtype") != "bf16":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if reduce_dtype_of(config) == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def shard(units: Sequence[tuple[str, Any]], *, mp_policy: Any = None,
          reshard_after_forward: bool | None = None) -> None:
    """``fully_shard`` every (path, module) of ``units``, in order: the root must come last.

    ``mp_policy``: a MixedPrecisionPolicy (``mixed_precision``), None for fp32 throughout.
    ``reshard_after_forward``: as fully_shard takes it; None is torch's default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for _path, module in units:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
