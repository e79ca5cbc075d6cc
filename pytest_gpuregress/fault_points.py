"""What the layers below faults/ need of it: ``FaultSpec`` (a parsed ``--gpuregress-inject`` spec), the fault
points, the mark of the plugin's own collectives and the profiler range of a fault's own work.

A function marked ``@fault_point("checkpoint.apply_optimizer")`` runs as written until a fault ``intercept``s it by
name (undone through ``ctx.cleanup_hooks``), so no fault patches this project's modules. Neutral, so scenarios and
training use it without an import up into faults/ (docs/architecture.md).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar


@dataclass(frozen=True)
class FaultSpec:
    """A validated fault: its kind and typed parameters. ``text`` is what the user wrote."""

    kind: str
    params: dict[str, Any]
    text: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    @property
    def ranks(self) -> frozenset[int] | None:
        return self.params.get("ranks", self.params.get("rank"))


def emulated_ops(specs: tuple[FaultSpec, ...] | list[FaultSpec]) -> tuple[str, ...]:
    """Collective ops a fault shim provides on this backend (only ``premul_sum`` today)."""
    return ("premul_sum",) if any(s.kind == "emulate_premul_sum" for s in specs) else ()


Function = TypeVar("Function", bound=Callable[..., Any])
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]  # original -> the function called in its place

# Every point, and what happens there; a fault names one of these (docs/faults.md has the bug classes).
POINTS: dict[str, str] = {
    "formats.decode": "uint8 codes read as a format (scenarios/formats/device.py)",
    "formats.cast": "float32 values cast to a format's codes",
    "formats.format_max": "a format's largest finite value, as a quantizer asks for it",
    "formats.fn_to_fnuz": "e4m3fn codes and scale converted to e4m3fnuz",
    "formats.mx_scale_exponent": "the MX shared exponent of a block",
    "checkpoint.gather": "the full state dict gathered for a save (scenarios/checkpoint/full_state.py)",
    "checkpoint.tensors_to_save": "the names that go into a full-state-dict file",
    "checkpoint.stack_load": "the stack's loader filling a model from a saved file",
    "checkpoint.sharded_save": "a DCP save of every rank's shards (scenarios/checkpoint/sharded.py)",
    "checkpoint.sharded_load": "a DCP load, at this run's world size",
    "checkpoint.apply_model": "loaded weights applied to a resumed trainer (training/resume_checkpoint.py)",
    "checkpoint.apply_optimizer": "loaded state applied to a resumed trainer's optimizer",
    "checkpoint.rng_restore": "every generator set from a saved state (training/rng_state.py)",
    "checkpoint.after_load": "every load's tensors, once they are in place (scenarios/checkpoint/hooks.py)",
    "lora.wrap": "a base model wrapped with LoRA (scenarios/lora/adapter.py)",
    "lora.gather_for_save": "the adapter's full state dict collected for a save (scenarios/lora/adapter_io.py)",
    "lora.write_adapter": "the adapter saved with save_pretrained",
    "lora.merge_and_unload": "the adapter merged into the base weights (scenarios/lora/merging.py)",
}

_wrappers: dict[str, list[Wrapper]] = {}
_chains: dict[tuple[str, Callable[..., Any]], Callable[..., Any]] = {}  # (point, function) -> wrapped, while intercepted


def _known(name: str) -> str:
    if name not in POINTS:
        raise KeyError(f"no fault point {name!r}; the points: {', '.join(POINTS)}")
    return name


def fault_point(name: str) -> Callable[[Function], Function]:
    """Mark ``function`` as point ``name``: each call goes through the wrappers intercepting it, if any."""
    _known(name)

    def mark(function: Function) -> Function:
        @functools.wraps(function)
        def through_faults(*args: Any, **kwargs: Any) -> Any:
            if not _wrappers.get(name):
                return function(*args, **kwargs)
            return _chain(name, function)(*args, **kwargs)

        return through_faults  # type: ignore[return-value]

    return mark


def _chain(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` wrapped by every wrapper of ``name``, the last intercepted outermost; built once per change."""
    key = (name, function)
    if key not in _chains:
        chained = function
        for wrap in _wrappers[name]:
            chained = wrap(chained)
        _chains[key] = chained
    return _chains[key]


def intercept(name: str, wrapper: Wrapper) -> Callable[[], None]:
    """Route every call of point ``name`` through ``wrapper(original)``; return the undo."""
    _wrappers.setdefault(_known(name), []).append(wrapper)
    _chains.clear()

    def undo() -> None:
        if wrapper in _wrappers.get(name, []):
            _wrappers[name].remove(wrapper)
            _chains.clear()

    return undo


def intercepted() -> list[str]:
    """The points a fault intercepts now (tests check that every undo ran)."""
    return [name for name, wrappers in _wrappers.items() if wrappers]


# The profiler range an injected fault does its own tensor work in (training/kernels.py's ``fault_region``): the
# kernel inventory and the op trace leave it out, so a fault's arithmetic (a nudge's comparison, a chunk's copy)
# never reads as a kernel or an op the stack changed.
FAULT_REGION = "gpuregress::fault"


class ThreadRegion:
    """A nestable "inside this region" mark, per thread: what a context manager sets and a hook reads (as
    training/kernels.py marks an emulated host fallback)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def enter(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0


_own = ThreadRegion()


def plugin_own_collectives() -> AbstractContextManager[None]:
    """Collectives the plugin makes for itself (the bandwidth probe, fail-fast's vote): no fault corrupts or counts
    them, so a fault that matches only these does not read as having fired on the training."""
    return _own.enter()


def in_plugin_own_collective() -> bool:
    return _own.active()
