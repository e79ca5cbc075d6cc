"""Collective faults, installed on a rank: corrupt the outputs of matching ``torch.distributed`` calls.

Every public collective (and the private forms older FSDP calls) is wrapped; the real call finishes, then
its output is corrupted where the filters match (op, size, dtype, reduction, rank, one call in N). Mode
``missing`` raises as a backend lacking the op does; ``truncate_bf16`` recomputes a bf16 SUM/AVG reduction
in float32 and cuts it toward zero instead of rounding.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from ..fault_points import in_plugin_own_collective
from ..training.kernels import fault_region
from . import FaultSpec
from .casts import truncated_bf16
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


# Reductions a truncating bf16 SUM recomputes, and where each keeps its input (torch.distributed's argument names).
TRUNCATED_FAMILIES = ("all_reduce", "reduce_scatter")
TRUNCATED_REDUCTIONS = ("sum", "avg")
_INPUT_ARGUMENT = ("tensor", "input", "input_list")


def reduce_op_name(op: Any) -> str | None:
    if op is None:
        return "sum"
    text = str(getattr(op, "op", op)).lower()  # a ReduceOp object (PREMUL_SUM) wraps its RedOpType
    for name in ("premul_sum", "avg", "max", "min", "product", "sum"):
        if name in text:
            return name
    return text


class CollectiveFault:
    def __init__(self, spec: FaultSpec, rank: int, world_size: int,
                 current_step: Callable[[], int | None] = lambda: None) -> None:
        self.spec = spec
        self.from_step = spec.get("from_step")  # a fault that starts late: only from this training step on
        self.current_step = current_step
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
        """Whether the fault acts on this call: its rank, step, op and size (``_selects``), dtype and reduction."""
        if not self._selects(family, size):
            return False
        first = _flat_outputs(out)[0]
        if self.dtype and str(first.dtype).replace("torch.", "") != self.dtype:
            return False
        return not (self.reduce_op and reduce_op_name(op) != self.reduce_op)

    def _selects(self, family: str, size: int) -> bool:
        """Whether a call of ``family`` moving ``size`` bytes, on this rank at this step, is one the spec names."""
        # A one-rank collective moves no data, so a transport bug cannot touch it.
        if self.world_size == 1 or family not in self.ops or not (self.min_bytes <= size <= self.max_bytes):
            return False
        # A missing op is missing on every rank: had one rank called it, that rank would wait for the others forever.
        if self.target_ranks is not None and self.rank not in self.target_ranks and self.mode != "missing":
            return False
        return self.from_step is None or (self.current_step() or 0) >= self.from_step

    @property
    def fired(self) -> int:
        return self.firing.count

    def truncates(self, family: str, size: int, out: Any, op: Any) -> bool:
        """Whether this call is a bf16 SUM or AVG reduction this fault recomputes with truncation (truncate_bf16)."""
        return (self.mode == "truncate_bf16" and family in TRUNCATED_FAMILIES and self.matches(family, size, out, op)
                and str(_flat_outputs(out)[0].dtype) == "torch.bfloat16" and reduce_op_name(op) in TRUNCATED_REDUCTIONS)

    def after(self, family: str, size: int, out: Any, op: Any, captured: tuple[Any, Any] | None = None) -> None:
        """Corrupt the finished call's output. ``captured``: (this rank's input in float32, group), taken before the
        call for truncate_bf16 (an all-reduce overwrites its input)."""
        if not self.matches(family, size, out, op) or (self.mode == "truncate_bf16" and captured is None):
            return
        self.calls += 1
        fire = self.calls % self.every == 0
        outputs = _flat_outputs(out)
        if self.mode == "truncate_bf16":
            if fire and captured is not None:
                _truncated_sum(family, outputs, *captured, average=reduce_op_name(op) == "avg")
                self.firing.fire()  # the call was rerouted through the truncating sum, whatever its inputs
        elif self.mode == "stale_chunk":
            self._stale_chunk(family, outputs, fire)
        elif fire and self._corrupt(outputs):
            self.firing.fire()

    def _stale_chunk(self, family: str, outputs: list[Any], fire: bool) -> None:
        """Keep this call's output for the next call of the same shape; where it fires, give one chunk back the
        previous call's value."""
        key = (family, str(outputs[0].dtype), tuple(tuple(t.shape) for t in outputs))
        previous = self.stale.get(key)
        self.stale[key] = [t.detach().clone() for t in outputs]
        if not fire or previous is None:
            return
        chunk = self.spec.get("chunk", -1)
        if len(outputs) > 1:  # list form: one tensor per rank
            outputs[chunk].copy_(previous[chunk])
        else:
            flat, old = outputs[0].view(-1), previous[0].view(-1)
            pieces = self.spec.get("pieces", 2)
            n = flat.numel() // pieces
            index = chunk % pieces
            flat[index * n : (index + 1) * n].copy_(old[index * n : (index + 1) * n])
        self.firing.fire()

    def _corrupt(self, outputs: list[Any]) -> bool:
        """Corrupt ``outputs`` as the mode says; False when there was nothing to corrupt (an empty output)."""
        flat = outputs[-1].view(-1)
        if flat.numel() == 0:
            return False
        corrupt = {"zeros": _zeros, "zero_tail": _zero_tail, "scale": _scale, "swap": _swap}.get(self.mode, _nudge)
        return corrupt(outputs, flat, self.spec)


def _zeros(outputs: list[Any], flat: Any, spec: FaultSpec) -> bool:
    for t in outputs:
        t.zero_()
    return True


def _zero_tail(outputs: list[Any], flat: Any, spec: FaultSpec) -> bool:
    flat[-spec.get("count", 8) :] = 0
    return True


def _scale(outputs: list[Any], flat: Any, spec: FaultSpec) -> bool:
    if not flat.is_floating_point():
        return False
    for t in outputs:
        t.mul_(1 + spec.get("rel", 1e-3))
    return True


def _swap(outputs: list[Any], flat: Any, spec: FaultSpec) -> bool:
    """Two elements exchanged: every sum holds, and on every rank alike, every hash."""
    if flat.numel() < 3:
        return False
    i, j = flat.numel() // 3, 2 * flat.numel() // 3
    flat[[i, j]] = flat[[j, i]].clone()
    return True


def _nudge(outputs: list[Any], flat: Any, spec: FaultSpec) -> bool:
    """One element off: by default the middle one, where neither head nor tail checks would look first."""
    import torch

    i = {"first": 0, "last": flat.numel() - 1}.get(spec.get("at", "middle"), flat.numel() // 2)
    if not flat.is_floating_point():
        flat[i] += 1
        return True
    value = flat[i].to(torch.float64)
    if spec.get("add") is not None:  # off by an absolute amount
        value = value + spec.get("add")
    else:
        rel = spec.get("rel", 1e-3)
        value = value * (1 + rel) if value != 0 else torch.tensor(rel, dtype=torch.float64)
    flat[i] = value.to(flat.dtype)
    return True


def _float32_input(bound: dict[str, Any]) -> Any:
    """This rank's whole input of a reduction, in float32: the in-place tensor, the input, or the input list joined."""
    import torch

    value = next(bound[key] for key in _INPUT_ARGUMENT if key in bound)
    return torch.cat([t.reshape(-1) for t in value]).float() if isinstance(value, (list, tuple)) else \
        value.detach().reshape(-1).float().clone()


def _truncated_sum(family: str, outputs: list[Any], mine: Any, group: Any, average: bool = False) -> None:
    """Overwrite ``outputs`` with the SUM (or, ``average``, the AVG) as a truncating backend computes it: every rank's
    input gathered in float32 (through the real all-gather), added in rank order in float32 (divided by the world
    size for AVG), then cut to bf16 toward zero by masking the low 16 bits of each float32, where a correct backend
    rounds to nearest even."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = torch.empty(world * mine.numel(), dtype=torch.float32, device=mine.device)
    dist.all_gather_into_tensor(gathered, mine, group=group)  # inside this fault's call: the real one runs
    total = gathered.view(world, -1)[0].clone()
    for r in range(1, world):
        total += gathered.view(world, -1)[r]
    if average:
        total /= world
    truncated = truncated_bf16(total)  # the sum cut toward zero, as the cast fault cuts a conversion
    if family == "reduce_scatter":
        truncated = truncated.view(world, -1)[rank]
    outputs[0].view(-1).copy_(truncated)  # a reduction has one output tensor


def _finished(work: Any) -> Any:
    """A finished stand-in for ``work``, already waited for, whose wait() writes nothing: gloo's reduce_scatter_single
    copies its result into the output again at every wait(), which would undo the fault the caller must see."""
    import torch.distributed as dist

    class FinishedWork(dist.Work):  # a Work, as torch's own _IllegalWork: callers may check the type
        def __init__(self, real: Any) -> None:
            super().__init__()
            self.real = real

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def is_success(self) -> bool:
            return True

        def exception(self) -> Any:
            return None

        def get_future(self) -> Any:
            return self.real.get_future()

    return FinishedWork(work)


def _wrap_collective(dist: Any, name: str, fault: CollectiveFault) -> Callable[[], None]:
    """Wrap ``dist.<name>``; return the undo (ranks outlive a launch, so no patch may outlive it)."""
    original = getattr(dist, name)
    family, out_key = COLLECTIVES[name]
    signature = inspect.signature(original)  # to find the op, group and input however the caller passed them

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(fault.local, "inside", False) or in_plugin_own_collective():  # nested, or the plugin's own call
            return original(*args, **kwargs)
        fault.local.inside = True
        try:
            out = kwargs.get(out_key, args[0] if args else None)
            size = max(nbytes(out), nbytes(args[1] if len(args) > 1 else kwargs.get("input", None)))
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:  # a call the real function will refuse: let it say why
                bound = kwargs
            op = bound.get("op")
            if fault.mode == "missing" and fault.matches(family, size, out, op):
                fault.firing.fire()  # as a backend without the op says it, before anything moves
                raise RuntimeError(f"Backend {dist.get_backend(bound.get('group'))} does not support {name.replace('_', '')}")
            captured = None
            if fault.truncates(family, size, out, op):
                with fault_region():
                    captured = (_float32_input(bound), bound.get("group"))
            work = original(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):  # async_op, given by keyword or position: finish first
                work.wait()
            acted = fault.firing.count
            with fault_region():  # the fault's own arithmetic stays out of the kernel inventory
                fault.after(family, size, out, op, captured)
            return _finished(work) if work is not None and fault.firing.count > acted else work
        finally:
            fault.local.inside = False

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(dist, name, wrapper)
    return lambda: setattr(dist, name, original)


def install(spec: FaultSpec, ctx: Any) -> Firing:
    import torch.distributed as dist

    fault = CollectiveFault(spec, ctx.rank, ctx.world_size, lambda: getattr(ctx, "current_step", None))
    for name in COLLECTIVES:
        if hasattr(dist, name):
            ctx.cleanup_hooks.append(_wrap_collective(dist, name, fault))
    return fault.firing


def install_premul_sum_emulation(spec: FaultSpec, ctx: Any) -> Firing:
    """Run PREMUL_SUM all-reduces as (input x factor) then SUM, as NCCL does internally, on gloo (which lacks it), so
    a fault on that path can be seen caught on a CPU. Install it before the ``collective`` fault."""
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
