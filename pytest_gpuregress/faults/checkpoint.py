"""Checkpoint faults, installed on a rank: the bug classes of docs/faults.md section 3, for scenario checkpoint.

Each mode (KINDS["checkpoint"] says what it does) intercepts ``checkpoint.*`` fault points, undone through
``ctx.cleanup_hooks``. Upstream reports: rank0_shard accelerate #4206, chunks_permuted ROCm/Megatron-LM #63,
untied transformers#38870.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..fault_points import intercept
from . import FaultSpec
from .firing import Firing
from .lora import target_module

MODES = ("optimizer_dropped", "rank0_shard", "chunks_permuted", "tied_key_dropped", "untied", "rng_not_restored",
         "weights_late", "ulp_nudge")


def install(spec: FaultSpec, ctx: Any) -> Firing:
    firing = Firing(spec.text)  # calls of the fault point the bug changed
    wraps: dict[str, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
        "optimizer_dropped": (("apply_optimizer", lambda original: lambda trainer, state: firing.fire()),),
        "rank0_shard": (("sharded_save", lambda original: _save_from_rank0_only(original, firing)),
                        ("gather", lambda original: lambda model: _local_shards(model, firing))),
        "chunks_permuted": (("sharded_load", lambda original: _permuting(original, firing)),),
        "tied_key_dropped": (("tensors_to_save", lambda original: _dropping_tied_key(original, firing)),),
        "untied": (("stack_load", lambda original: _untying(original, firing)),),
        "rng_not_restored": (("rng_restore", lambda original: lambda states, device_kind: firing.fire()),),
        "weights_late": (("apply_model", lambda original: _one_step_late(original, ctx, firing)),),
        "ulp_nudge": (("after_load", lambda original: _nudging(original, f"{target_module(spec)}.weight", firing)),),
    }
    for point, wrap in wraps[spec.get("mode")]:
        ctx.cleanup_hooks.append(intercept(f"checkpoint.{point}", wrap))
    return firing


def _save_from_rank0_only(original: Any, firing: Firing) -> Any:
    def save(state: dict[str, Any], folder: Any) -> None:
        import shutil
        import tempfile
        from pathlib import Path

        import torch.distributed as dist

        if dist.get_rank() == 0:
            return original(state, folder)
        firing.fire()
        scratch = Path(tempfile.mkdtemp(prefix="gpuregress-lost-shard-"))
        try:  # the save stays collective; this rank's shard lands where no reader looks
            original(state, scratch / folder.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return save


def _local_shards(model: Any, firing: Firing) -> dict[str, Any]:
    import torch.distributed as dist

    firing.fire()
    if dist.get_rank() != 0:
        return {}
    return {name: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu().clone()
            for name, value in model.state_dict().items()}


def _tensors(state: dict[str, Any]) -> list[Any]:
    """Every tensor of a nested state dict, in a fixed order (the same on every rank)."""
    out = []
    for key in sorted(state):
        value = state[key]
        out += _tensors(value) if isinstance(value, dict) else [value]
    return out


def _permuting(original: Any, firing: Firing) -> Any:
    def load(state: dict[str, Any], folder: Any, saved_world: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, distribute_tensor

        original(state, folder, saved_world)
        pieces = max(dist.get_world_size(), saved_world)
        if dist.get_world_size() == saved_world:
            return
        with torch.no_grad():
            for tensor in _tensors(state):
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if whole.ndim == 0 or whole.shape[0] < pieces:
                    continue
                permuted = torch.cat(list(whole.chunk(pieces, dim=0))[::-1])
                if isinstance(tensor, DTensor):
                    tensor.to_local().copy_(distribute_tensor(permuted, tensor.device_mesh, tensor.placements).to_local())
                else:
                    tensor.copy_(permuted)
                firing.fire()
    return load


def _dropping_tied_key(original: Any, firing: Firing) -> Any:
    def tensors_to_save(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
        kept = original(state, groups)
        stored = {group[0] for group in groups if len(group) > 1}
        firing.fire(len(stored & set(kept)))
        return {name: tensor for name, tensor in kept.items() if name not in stored}
    return tensors_to_save


def _untying(original: Any, firing: Firing) -> Any:
    def stack_load(model: Any, path: Any) -> None:
        import torch

        from ..scenarios.checkpoint.portable import tie_groups

        original(model, path)
        for group in tie_groups(model):  # the stack loaded into the tie; now each alias gets its own copy
            for alias in group[1:]:
                owner, _, attr = alias.rpartition(".")
                module = model.get_submodule(owner)
                setattr(module, attr, torch.nn.Parameter(getattr(module, attr).detach().clone()))
                firing.fire()
    return stack_load


def _one_step_late(original: Any, ctx: Any, firing: Firing) -> Any:
    def apply_model(trainer: Any, model_state: dict[str, Any]) -> None:
        pending = [model_state]

        def after_step(rank: int, step: int) -> None:
            if pending:  # after the first step the resumed run took, with the weights it was built with
                firing.fire()  # only now has a step run on the wrong weights
                original(trainer, pending.pop())
        ctx.step_hooks.append(after_step)
    return apply_model


def _nudging(original: Any, name: str, firing: Firing) -> Any:
    def after_load(tensors: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        original(tensors)
        tensor = tensors.get(name)
        if tensor is None:
            return
        if hasattr(tensor, "to_local"):
            if dist.get_rank() != 0:  # sharded along dim 0: element 0 is rank 0's
                return
            tensor = tensor.to_local()
        with torch.no_grad():
            flat = tensor.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype, device=flat.device))
        firing.fire()
    return after_load
