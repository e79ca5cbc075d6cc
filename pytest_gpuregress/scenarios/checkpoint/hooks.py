"""Rank side: the hook every load in this scenario calls once its tensors are in place.

A no-op. It is a fault point (fault_points.py), so a fault can change what was loaded
(faults/checkpoint.py: one tensor nudged by one ulp after load) at one point that every load path
shares: the full-state-dict and tied reloads, the DCP loads of the sharded and resume cases, and the
portability load.
"""

from __future__ import annotations

from typing import Any

from ...fault_points import fault_point


@fault_point("checkpoint.after_load")
def after_load(tensors: dict[str, Any]) -> None:
    """``tensors``: name -> the loaded tensor as the model now holds it (a DTensor shard under FSDP2)."""
