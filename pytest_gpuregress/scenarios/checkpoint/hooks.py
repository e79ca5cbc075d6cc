"""Rank side: the hook every load in this scenario calls once its tensors are in place.

A no-op and a fault point: one place, shared by every load path, where a fault can change what was loaded
(faults/checkpoint.py nudges one tensor by one ulp).
"""

from __future__ import annotations

from typing import Any

from ...fault_points import fault_point


@fault_point("checkpoint.after_load")
def after_load(tensors: dict[str, Any]) -> None:
    """``tensors``: name -> the loaded tensor as the model now holds it (a DTensor shard under FSDP2)."""
