"""Collective faults, installed on a rank: corrupt the outputs of matching ``torch.distributed`` calls.

Every public collective of ``torch.distributed`` (and the private single-tensor forms older FSDP
releases call) is wrapped; the wrapper lets the real call finish, then corrupts its output when
the spec's filters match: op family, message size, dtype, reduction, rank, and one call in N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..fault_points import in_plugin_own_collective
from ..training.kernels import fault_region
from . import FaultSpec
from .firing import Firing

# dist function -> (op family, keyword of the output argument, which is always the first)
COLLECTIVES: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce_scatter_single": ("reduce_scatter", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "output"),
    "_reduce_scatter_base": ("reduce_scatter", "output"),
    "reduce_scatter": ("reduce_scatter", "output"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "broadcast": ("broadcast", "tensor"),
    "all_to_all_single": ("all_to_all", "output"),
    "all_to_all": ("all_to_all", "output_tensor_list"),
}


def nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else 0


def _flat_outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def reduce_op_name(op: Any) -> str | None:
    if op is None:
        return "sum"
    text = str(getattr(op, "op", op)).lower()  # a ReduceOp object (PREMUL_SUM) wraps its RedOpType
    for name in ("premul_sum", "avg", "max", "min", "product", "sum"):
        if name in text:
            return name
    return text


class CollectiveFault:
    def __init__(self, spec: FaultSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.ops = spec.get("op") or frozenset(_family for _family, _ in COLLECTIVES.values())
        self.min_bytes = spec.get("min_bytes", 0.0)
        self.max_bytes = spec.get("max_bytes", float("inf"))
        self.dtype = spec.get("dtype")  # a torch dtype name: the spec parser mapped bf16 to bfloat16
        self.reduce_op = spec.get("reduce_op")
        self.mode = spec.get("mode", "nudge")
        self.every = max(1, spec.get("every", 1))
        self.target_ranks = spec.ranks
        self.calls = 0
        self.firing = Firing(spec.text)  # outputs actually corrupted: a fault that never fired proves nothing
        self.stale: dict[tuple[Any, ...], list[Any]] = {}
        # "Inside one of my wrapped calls", per fault and thread: one collective implemented through another is
        # corrupted once, and a second fault stacked on this one still sees (and corrupts) the same call.
        self.local = threading.local()

    def matches(self, family: str, size: int, out: Any, op: Any) -> bool:
        if self.world_size == 1:  # a one-rank collective moves no data, so a transport bug cannot touch it
            return False
        if family not in self.ops or not (self.min_bytes <= size <= self.max_bytes):
            return False
        if self.target_ranks is not None and self.rank not in self.target_ranks:
            return False
        first = _flat_outputs(out)[0]
        if self.dtype and str(first.dtype).replace("torch.", "") != self.dtype:
            return False
        return not (self.reduce_op and reduce_op_name(op) != self.reduce_op)

    @property
    def fired(self) -> int:
        return self.firing.count

    def after(self, family: str, size: int, out: Any, op: Any) -> None:
        if not self.matches(family, size, out, op):
            return
        self.calls += 1
        fire = self.calls % self.every == 0
        outputs = _flat_outputs(out)
        if self.mode == "stale_chunk":
            key = (family, str(outputs[0].dtype), tuple(tuple(t.shape) for t in outputs))
            previous = self.stale.get(key)
            self.stale[key] = [t.detach().clone() for t in outputs]
            if fire and previous is not None:
                self._restore_chunk(outputs, previous)
                self.firing.fire()
        elif fire and self._corrupt(outputs):
            self.firing.fire()

    def _restore_chunk(self, outputs: list[Any], previous: list[Any]) -> None:
        chunk = self.spec.get("chunk", -1)
        if len(outputs) > 1:  # list form: one tensor per rank
            outputs[chunk].copy_(previous[chunk])
            return
        flat, old = outputs[0].view(-1), previous[0].view(-1)
        pieces = self.spec.get("pieces", 2)
        n = flat.numel() // pieces
        index = chunk % pieces
        flat[index * n : (index + 1) * n].copy_(old[index * n : (index + 1) * n])

    def _corrupt(self, outputs: list[Any]) -> bool:
        """Corrupt ``outputs``; False when there was nothing to corrupt (an empty output)."""
        import torch

        flat = outputs[-1].view(-1)
        if flat.numel() == 0:
            return False
        if self.mode == "zeros":
            for t in outputs:
                t.zero_()
        elif self.mode == "zero_tail":
            flat[-self.spec.get("count", 8) :] = 0
        else:  # nudge one element in the middle, where neither head nor tail checks would look first
            i = flat.numel() // 2
            if flat.is_floating_point():
                rel = self.spec.get("rel", 1e-3)
                value = flat[i].to(torch.float64)
                flat[i] = (value * (1 + rel) if value != 0 else torch.tensor(rel, dtype=torch.float64)).to(flat.dtype)
            else:
                flat[i] += 1
        return True


def _wrap_collective(dist: Any, name: str, fault: CollectiveFault) -> Callable[[], None]:
    """Wrap ``dist.<name>``; return the undo (ranks outlive a launch, so no patch may outlive it)."""
    original = getattr(dist, name)
    family, out_key = COLLECTIVES[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(fault.local, "inside", False) or in_plugin_own_collective():  # nested, or the plugin's own call
            return original(*args, **kwargs)
        fault.local.inside = True
        try:
            out = kwargs.get(out_key, args[0] if args else None)
            size = max(nbytes(out), nbytes(args[1] if len(args) > 1 else kwargs.get("input", None)))
            work = original(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):  # async_op, given by keyword or position: finish first
                work.wait()
            with fault_region():  # the fault's own arithmetic stays out of the kernel inventory
                fault.after(family, size, out, kwargs.get("op"))
            return work
        finally:
            fault.local.inside = False

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(dist, name, wrapper)
    return lambda: setattr(dist, name, original)


def install(spec: FaultSpec, ctx: Any) -> Firing:
    import torch.distributed as dist

    fault = CollectiveFault(spec, ctx.rank, ctx.world_size)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            ctx.cleanup_hooks.append(_wrap_collective(dist, name, fault))
    return fault.firing


def install_premul_sum_emulation(spec: FaultSpec, ctx: Any) -> Firing:
    """Run PREMUL_SUM all-reduces as (input x factor) then SUM, as NCCL does internally.

    Only for backends without PREMUL_SUM (gloo), so a fault on that path can be injected and seen
    caught on a CPU. Install it before the ``collective`` fault that should corrupt its output.
    """
    import torch.distributed as dist

    original = dist.all_reduce
    emulated = Firing(spec.text)  # calls emulated, for the notes: a shim need not fire (KINDS)

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if reduce_op_name(op) == "premul_sum":
            tensor.mul_(op.__getstate__()[1])
            op = dist.ReduceOp.SUM
            emulated.fire()
        return original(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    ctx.cleanup_hooks.append(lambda: setattr(dist, "all_reduce", original))
    return emulated
