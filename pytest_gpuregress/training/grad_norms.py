"""A gradient's squared norm as this rank's share of the global one, whatever the gradient's layout.

FSDP2 shards add up over ranks; replicas are divided by the world size, so a rank whose replica disagrees
still moves the sum. Other DTensors are gathered whole (a collective). A missing gradient counts as zero.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from typing import Any


def shard_dim_over_world(tensor: Any, world_size: int) -> int | None:
    """The dim a DTensor is sharded along when its mesh is 1-D over every rank (FSDP2), else None."""
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim != 1 or mesh.size() != world_size or not placements[0].is_shard():
        return None
    return int(placements[0].dim)


def local_part(tensor: Any, world_size: int) -> tuple[Any, bool]:
    """(this rank's part, whether parts add up over ranks): an FSDP2 shard's local shard, any other DTensor
    gathered (collective), a plain tensor as a replica."""
    if not hasattr(tensor, "to_local"):
        return tensor, False
    if shard_dim_over_world(tensor, world_size) is not None:
        return tensor.to_local(), True
    return tensor.full_tensor(), False


def squared_norms(params: list[Any], world_size: int, device: Any) -> list[Any]:
    """Each parameter's squared gradient norm (float64 0-dim on ``device``), scaled so that its sum over ranks is
    the global one."""
    import torch

    squares = []
    for param in params:
        if param.grad is None:
            squares.append(torch.zeros((), dtype=torch.float64, device=device))
            continue
        local, sharded = local_part(param.grad, world_size)
        square = local.detach().double().pow(2).sum().to(device)  # offloaded gradients live on the host
        squares.append(square if sharded else square / world_size)
    return squares
