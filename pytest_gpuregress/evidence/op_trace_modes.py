"""How the op trace sees each dispatched op: torch's DebugMode where it exists (torch 2.10 on), ours otherwise.

Both hand the tracer ops on plain tensors only (DTensor's local ops come back as plain ones) and only read.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

# What DebugMode records of its own that the tracer does not need (it keeps what it needs): strings of outputs,
# profiler regions, DTensors' local tensors. Passed only where this torch's DebugMode has the switch: torch 2.10's
# lacks some that 2.11 has, and a switch it lacks records nothing anyway.
_DEBUG_MODE_OFF = ("record_output", "record_profiler_context", "record_localtensor")


class OpWatcher(Protocol):
    def before(self, func: Any, args: Any, kwargs: Any) -> None: ...

    def after(self, func: Any, args: Any, kwargs: Any, result: Any) -> None: ...


def _faked() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return isinstance(_get_current_dispatch_mode(), FakeTensorMode)


@contextmanager
def unwatched() -> Iterator[None]:
    """Run the plugin's own reads of the step's tensors (the collective ledger's sums) with no dispatch mode on:
    they are no ops of the step, and a trace that held them would change with what a process had cached."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # a torch without it (private API): the reads are traced, which costs a note, not the run
        yield
        return
    with _disable_current_modes():
        yield


def has_debug_mode() -> bool:
    """Whether this torch's DebugMode can serve the trace: it exists and its dispatch hooks take a pre-dispatch
    hook (``pre_log_hook``), which the tracer needs to see an op's inputs before a fault or the op writes them."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return False
    hooks = getattr(DebugMode, "dispatch_hooks", None)
    try:
        return hooks is not None and "pre_log_hook" in inspect.signature(hooks).parameters
    except (TypeError, ValueError):  # a signature Python cannot read: do not guess
        return False


def debug_mode_switches(debug_mode: Any) -> dict[str, bool]:
    """The recording switches to turn off (``_DEBUG_MODE_OFF``) that this torch's DebugMode takes."""
    try:
        accepted = inspect.signature(debug_mode.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: False for name in _DEBUG_MODE_OFF if name in accepted}


class _DebugModeWatch:
    """DebugMode with a pre- and a post-dispatch hook: entered once per phase."""

    name = "DebugMode"

    def __init__(self, watcher: OpWatcher) -> None:
        from torch.utils._debug_mode import DebugMode

        self._watcher = watcher
        # No strings of outputs, no stacks, no module tracking of its own: the tracer keeps what it needs.
        self._mode = DebugMode(**debug_mode_switches(DebugMode))
        self._hooks: AbstractContextManager[Any] | None = None

    def _before(self, func: Any, types: Any, args: Any, kwargs: Any, call: Any) -> None:
        if not types and not _faked():
            self._watcher.before(func, args, kwargs)

    def _after(self, func: Any, types: Any, args: Any, kwargs: Any, result: Any) -> None:
        if not types and not _faked():
            self._watcher.after(func, args, kwargs, result)
        self._mode.operators.clear()  # its own log of every call: not needed, and it grows with the step

    def __enter__(self) -> _DebugModeWatch:
        from torch.utils._debug_mode import DebugMode

        self._hooks = DebugMode.dispatch_hooks(log_hook=self._after, pre_log_hook=self._before)
        self._hooks.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


def _dispatch_mode_watch(watcher: OpWatcher) -> Any:
    """A TorchDispatchMode handing the same ops as DebugMode does to ``watcher``."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class DispatchWatch(TorchDispatchMode):
        name = "TorchDispatchMode"

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if DTensor in types:
                return NotImplemented  # DTensor runs it, and its local ops come back here
            plain = not types and not _faked()
            if plain:
                watcher.before(func, args, kwargs)
            result = func(*args, **kwargs)
            if plain:
                watcher.after(func, args, kwargs, result)
            return result

    return DispatchWatch()


def op_watch(watcher: OpWatcher, backend: str = "auto") -> Any:
    """A context manager, entered once per phase, that shows ``watcher`` every traced op.

    ``backend``: "DebugMode", "TorchDispatchMode", or "auto" (DebugMode where torch has it)."""
    if backend == "DebugMode" or (backend == "auto" and has_debug_mode()):
        return _DebugModeWatch(watcher)
    return _dispatch_mode_watch(watcher)
