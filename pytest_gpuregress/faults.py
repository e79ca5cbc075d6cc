"""Fault injection: emulate the stack bugs this plugin exists to catch, on any machine.

A fault is a spec string ``kind:key=value,key=value`` installed in every rank before the scenario
runs (``--gpuregress-inject``). Tests use it to prove each detector fires; users can use it to
prove the detectors fire on their own stack. Kinds:

  collective    corrupt the output of collectives, e.g.
                ``collective:op=reduce_scatter,min_bytes=1024,max_bytes=65536,mode=nudge,rel=1e-3``
                op: all_reduce|reduce_scatter|all_gather|broadcast|all_to_all ('|'-separated)
                mode: nudge (one element x (1+rel)), zero_tail (last ``count`` elements), zeros,
                      stale_chunk (chunk ``chunk`` keeps the previous call's value)
                filters: min_bytes, max_bytes (size = the larger of input and output buffers),
                dtype, reduce_op (sum|avg|max|min|premul_sum), ranks ('|'-separated), every=N
                (fire on 1 matching call in N)
  lr_scale      ``lr_scale:factor=1.01``: every optimizer step uses lr x factor
  linear_noise  ``linear_noise:rel=1e-7``: every F.linear output x (1+rel) (legitimate kernel drift)
  hang          ``hang:rank=1,step=5``: the rank sleeps after completing that step
  crash         ``crash:rank=1,step=3,how=raise|exit|abort``
  teardown_abort ``teardown_abort:rank=1``: SIGABRT after results are delivered (what gloo does
                at exit on torch 2.13); a correct launcher ignores it
  emulate_premul_sum  give gloo a PREMUL_SUM all-reduce (input x factor, then SUM) so that a
                ``collective:reduce_op=premul_sum`` fault can be shown caught on a CPU
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import BadFaultSpec

# dist function -> (op family, keyword of the output argument, which is always the first)
_COLLECTIVES: dict[str, tuple[str, str]] = {
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
_MODES = ("nudge", "zero_tail", "zeros", "stale_chunk")
_local = threading.local()


@dataclass
class FaultSpec:
    kind: str
    params: dict[str, str]
    text: str

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.params.get(key, default)

    def num(self, key: str, default: float) -> float:
        try:
            return float(self.params.get(key, default))
        except ValueError:
            raise BadFaultSpec(f"fault {self.text!r}: {key} must be a number") from None

    def ranks(self) -> set[int] | None:
        value = self.params.get("ranks", self.params.get("rank"))
        return None if value is None else {int(r) for r in value.split("|")}


def parse(text: str) -> FaultSpec:
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _INSTALLERS:
        raise BadFaultSpec(f"fault {text!r}: unknown kind {kind!r}; known: {sorted(_INSTALLERS)}")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise BadFaultSpec(f"fault {text!r}: {item!r} is not key=value")
        params[key.strip()] = value.strip()
    spec = FaultSpec(kind, params, text)
    if kind == "collective" and spec.get("mode", "nudge") not in _MODES:
        raise BadFaultSpec(f"fault {text!r}: mode must be one of {_MODES}")
    return spec


def install(specs: list[str], ctx: Any) -> list[str]:
    """Install every fault in this process; return the specs that apply to this rank."""
    installed = []
    for text in specs:
        spec = parse(text)
        ranks = spec.ranks()
        if spec.kind != "collective" and ranks is not None and ctx.rank not in ranks:
            continue
        _INSTALLERS[spec.kind](spec, ctx)
        installed.append(text)
    return installed


# --- collectives -------------------------------------------------------------------------------


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else 0


def _flat_outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class _CollectiveFault:
    def __init__(self, spec: FaultSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.ops = set((spec.get("op") or "all_reduce|reduce_scatter|all_gather|broadcast|all_to_all").split("|"))
        self.min_bytes = spec.num("min_bytes", 0)
        self.max_bytes = spec.num("max_bytes", float("inf"))
        self.dtype = spec.get("dtype")
        self.reduce_op = spec.get("reduce_op")
        self.mode = spec.get("mode", "nudge") or "nudge"
        self.every = max(1, int(spec.num("every", 1)))
        self.target_ranks = spec.ranks()
        self.calls = 0
        self.stale: dict[tuple[Any, ...], list[Any]] = {}

    def matches(self, family: str, size: int, out: Any, op: Any) -> bool:
        if family not in self.ops or not (self.min_bytes <= size <= self.max_bytes):
            return False
        if self.target_ranks is not None and self.rank not in self.target_ranks:
            return False
        first = _flat_outputs(out)[0]
        if self.dtype and str(first.dtype).replace("torch.", "") != self.dtype:
            return False
        if self.reduce_op and _reduce_op_name(op) != self.reduce_op:
            return False
        return True

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
        elif fire:
            self._corrupt(outputs)

    def _restore_chunk(self, outputs: list[Any], previous: list[Any]) -> None:
        chunk = int(self.spec.num("chunk", -1))
        if len(outputs) > 1:  # list form: one tensor per rank
            outputs[chunk].copy_(previous[chunk])
            return
        flat, old = outputs[0].view(-1), previous[0].view(-1)
        pieces = int(self.spec.num("pieces", 2))
        n = flat.numel() // pieces
        index = chunk % pieces
        flat[index * n : (index + 1) * n].copy_(old[index * n : (index + 1) * n])

    def _corrupt(self, outputs: list[Any]) -> None:
        import torch

        flat = outputs[-1].view(-1)
        if flat.numel() == 0:
            return
        if self.mode == "zeros":
            for t in outputs:
                t.zero_()
        elif self.mode == "zero_tail":
            flat[-int(self.spec.num("count", 8)) :] = 0
        else:  # nudge one element in the middle, where neither head nor tail checks would look first
            i = flat.numel() // 2
            if flat.is_floating_point():
                rel = self.spec.num("rel", 1e-3)
                value = flat[i].to(torch.float64)
                flat[i] = (value * (1 + rel) if value != 0 else torch.tensor(rel, dtype=torch.float64)).to(flat.dtype)
            else:
                flat[i] += 1


def _reduce_op_name(op: Any) -> str | None:
    if op is None:
        return "sum"
    text = str(getattr(op, "op", op)).lower()  # a ReduceOp object (PREMUL_SUM) wraps its RedOpType
    for name in ("premul_sum", "avg", "max", "min", "product", "sum"):
        if name in text:
            return name
    return text


def _wrap_collective(dist: Any, name: str, fault: _CollectiveFault) -> None:
    original = getattr(dist, name)
    family, out_key = _COLLECTIVES[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "inside", False):  # one collective implemented through another
            return original(*args, **kwargs)
        _local.inside = True
        try:
            out = kwargs.get(out_key, args[0] if args else None)
            size = max(_nbytes(out), _nbytes(args[1] if len(args) > 1 else kwargs.get("input", None)))
            work = original(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()
            fault.after(family, size, out, kwargs.get("op"))
            return work
        finally:
            _local.inside = False

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(dist, name, wrapper)


def _install_collective(spec: FaultSpec, ctx: Any) -> None:
    import torch.distributed as dist

    fault = _CollectiveFault(spec, ctx.rank)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            _wrap_collective(dist, name, fault)


# --- training-level faults ---------------------------------------------------------------------


def _install_lr_scale(spec: FaultSpec, ctx: Any) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    factor = spec.num("factor", 1.01)
    saved: dict[int, list[float]] = {}

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        saved[id(optimizer)] = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, saved.pop(id(optimizer), [])):
            group["lr"] = lr

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def _install_linear_noise(spec: FaultSpec, ctx: Any) -> None:
    import torch.nn.functional as F

    rel = spec.num("rel", 1e-7)
    original = F.linear

    def linear(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs) * (1 + rel)

    F.linear = linear


def _step_fault(spec: FaultSpec, action: Callable[[], None]) -> Callable[[int, int], None]:
    at_step = int(spec.num("step", 1))

    def hook(rank: int, step: int) -> None:
        if step == at_step:
            action()

    return hook


def _install_hang(spec: FaultSpec, ctx: Any) -> None:
    seconds = spec.num("seconds", 3600)
    ctx.step_hooks.append(_step_fault(spec, lambda: time.sleep(seconds)))


def _crash_now(how: str) -> None:
    if how == "exit":
        os._exit(17)
    if how == "abort":
        os.abort()
    raise RuntimeError("injected crash (fault 'crash')")


def _install_crash(spec: FaultSpec, ctx: Any) -> None:
    how = spec.get("how", "raise") or "raise"
    ctx.step_hooks.append(_step_fault(spec, lambda: _crash_now(how)))


def _install_emulate_premul_sum(spec: FaultSpec, ctx: Any) -> None:
    """Run PREMUL_SUM all-reduces as (input x factor) then SUM, as NCCL does internally.

    Only for backends without PREMUL_SUM (gloo), so a fault on that path can be injected and seen
    caught on a CPU. Install it before the ``collective`` fault that should corrupt its output.
    """
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if _reduce_op_name(op) == "premul_sum":
            tensor.mul_(op.__getstate__()[1])
            op = dist.ReduceOp.SUM
        return original(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    ctx.config["emulated_ops"] = [*ctx.config.get("emulated_ops", []), "premul_sum"]


def _install_teardown_abort(spec: FaultSpec, ctx: Any) -> None:
    ctx.teardown_hooks.append(os.abort)


_INSTALLERS: dict[str, Callable[[FaultSpec, Any], None]] = {
    "collective": _install_collective,
    "lr_scale": _install_lr_scale,
    "linear_noise": _install_linear_noise,
    "hang": _install_hang,
    "crash": _install_crash,
    "teardown_abort": _install_teardown_abort,
    "emulate_premul_sum": _install_emulate_premul_sum,
}
