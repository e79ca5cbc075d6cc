"""The kernel inventory of a few steady training steps, taken on a rank with ``torch.profiler``.

Per Python-level aten op: the aten ops it dispatched to (how SDPA or ``linear`` chose), the device kernels
under it, and its call count. A dispatch mode also sees floating-point work on the host during a GPU run:
a missing kernel that fell back to the CPU (emulated on CPU-only builds by ``host_fallback()``).
"""

from __future__ import annotations

import operator
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..fault_points import FAULT_REGION, ThreadRegion

# A host op smaller than this is bookkeeping (an optimizer's step counter, a scalar loss), not a kernel.
HOST_OP_MIN_ELEMENTS = 64
# Copies between devices are how data reaches the accelerator, and fills and random draws are how a loop
# makes its inputs (a dropout mask from the CPU generator): neither is compute that fell back.
_NOT_COMPUTE = {"aten::_to_copy", "aten::copy_", "aten::to", "aten::_copy_from", "aten::_local_scalar_dense",
                "aten::lift_fresh", "aten::detach", "aten::alias", "aten::fill_", "aten::zero_", "aten::uniform_",
                "aten::normal_", "aten::bernoulli_", "aten::random_", "aten::exponential_"}

_emulation = threading.local()


@contextmanager
def fault_region() -> Iterator[None]:
    """Run a fault's own tensor ops outside the kernel inventory."""
    from torch.profiler import record_function

    with record_function(FAULT_REGION):
        yield


def emulated_accelerator() -> str | None:
    """The accelerator a CPU run pretends to be (set by the ``host_op`` fault on CPU builds), else None."""
    return getattr(_emulation, "device", None)


def set_emulated_accelerator(device: str | None) -> None:
    _emulation.device = device


_host_region = ThreadRegion()


def host_fallback() -> AbstractContextManager[None]:
    """Mark the ops run inside as host ops: the device tag of the emulation (a no-op on a real GPU run)."""
    return _host_region.enter()


def short_kernel(name: str) -> str:
    """A device kernel's name without return type, parameters and all template arguments but the first, which names
    a generic wrapper's configuration (``cutlass::Kernel2<cutlass_80_tensorop_...>``)."""
    name = re.sub(r"^void ", "", name.strip())
    outer, bracket, rest = name.partition("<")
    if not bracket:
        return outer.split("(", 1)[0].strip()
    depth, first = 0, ""
    for char in rest:
        if char in ",>" and depth == 0:
            break
        depth += {"<": 1, ">": -1}.get(char, 0)
        first += char
    return f"{outer.strip()}<{first.strip()}>"


def _under_aten(event: Any) -> bool:
    """Called by another aten op (not from Python), or by an injected fault: not the stack's own top-level op."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") or parent.name == FAULT_REGION:
            return True
        parent = parent.cpu_parent
    return False


def _device_kernels(event: Any) -> set[str]:
    found = {short_kernel(k.name) for k in getattr(event, "kernels", ()) or ()}
    for child in event.cpu_children:
        found |= _device_kernels(child)
    return found


def inventory_from_events(events: Any) -> dict[str, dict[str, Any]]:
    """op -> {"dispatch": [...], "kernels": [...], "calls": n} from a profiler's function events."""
    inventory: dict[str, dict[str, Any]] = {}
    for event in events:
        if not event.name.startswith("aten::") or _under_aten(event):
            continue
        entry = inventory.setdefault(event.name, {"dispatch": set(), "kernels": set(), "calls": 0})
        entry["dispatch"] |= {c.name for c in event.cpu_children if c.name.startswith("aten::")}
        entry["kernels"] |= _device_kernels(event)
        entry["calls"] += 1
    return {op: {"dispatch": sorted(e["dispatch"]), "kernels": sorted(e["kernels"]), "calls": e["calls"]}
            for op, e in sorted(inventory.items())}


def add_inventory(into: dict[str, dict[str, Any]], found: dict[str, dict[str, Any]],
                  calls: Callable[[int, int], int] = operator.add) -> None:
    """Fold the inventory ``found`` into ``into``: kernels united, calls combined by ``calls`` (added over one
    rank's steps; the largest over ranks, which ran the same steps)."""
    for op, entry in found.items():
        merged = into.setdefault(op, {"dispatch": [], "kernels": [], "calls": 0})
        merged["dispatch"] = sorted(set(merged["dispatch"]) | set(entry["dispatch"]))
        merged["kernels"] = sorted(set(merged["kernels"]) | set(entry["kernels"]))
        merged["calls"] = calls(merged["calls"], entry["calls"])


def add_host_ops(into: dict[str, dict[str, Any]], found: dict[str, dict[str, Any]]) -> None:
    """Fold the host ops ``found`` into ``into``: calls added, the first shape and dtype kept."""
    for op, entry in found.items():
        into.setdefault(op, {**entry, "calls": 0})["calls"] += entry["calls"]


def _host_watcher() -> Any:
    """A dispatch mode that records floating-point work on the host, per kernel-level op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    emulated = emulated_accelerator() is not None

    class HostOpWatcher(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.host_ops: dict[str, dict[str, Any]] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = "aten::" + func.overloadpacket.__name__ if func.namespace == "aten" else str(func)
            if name not in _NOT_COMPUTE:  # judged by its inputs: an op that only creates a tensor computes nothing
                self._note(name, [*args, *(kwargs or {}).values()])
            return out

        def _note(self, name: str, values: list[Any]) -> None:
            # float64 on the host is the training loop's own bookkeeping (loss and norm statistics), never a
            # kernel that fell back: models compute in fp32, bf16 or lower.
            tensors = [t for t in torch.utils._pytree.tree_leaves(values)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                       and t.numel() >= HOST_OP_MIN_ELEMENTS]
            if not tensors:
                return
            on_host = _host_region.active() if emulated else all(t.device.type == "cpu" for t in tensors)
            if not on_host:
                return
            largest = max(tensors, key=lambda t: t.numel())
            entry = self.host_ops.setdefault(name, {"calls": 0, "shape": list(largest.shape),
                                                    "dtype": str(largest.dtype).replace("torch.", "")})
            entry["calls"] += 1

    return HostOpWatcher()


class KernelWindow:
    """Profiles the steps inside ``capture()`` into ``inventory``, watches those inside ``watch_host()`` into
    ``host_ops``; never both in one step (under a dispatch mode the profiler sees composites decomposed)."""

    def __init__(self, device_kind: str) -> None:
        self.accelerator = "cuda" if device_kind == "cuda" else emulated_accelerator()
        self.inventory: dict[str, dict[str, Any]] = {}
        self.host_ops: dict[str, dict[str, Any]] = {}
        self.captured = self.watched = False  # a run stopped early (fail-fast) may never reach the window
        self._device_kind = device_kind

    @contextmanager
    def capture(self) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._device_kind == "cuda" else [])
        with profile(activities=activities) as prof:
            yield
        self.captured = True
        add_inventory(self.inventory, inventory_from_events(prof.events()))

    @contextmanager
    def watch_host(self) -> Iterator[None]:
        if not self.accelerator:  # a CPU run: the host is where everything belongs
            yield
            return
        watcher = _host_watcher()
        with watcher:
            yield
        self.watched = True
        add_host_ops(self.host_ops, watcher.host_ops)

    def results(self) -> dict[str, Any]:
        """What a record keeps: the inventory, and the host ops of a GPU (or emulated GPU) run; only what ran."""
        out: dict[str, Any] = {}
        if self.captured:
            out["kernels"] = self.inventory
        if self.accelerator and self.watched:
            out["host_ops"] = {"accelerator": self.accelerator, "ops": self.host_ops}
        return out
