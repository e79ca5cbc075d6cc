"""Process-level faults, installed on a rank: hang, crash, or abort at teardown."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from . import FaultSpec
from .firing import Firing


def _after_step(spec: FaultSpec, ctx: Any, action: Callable[[], None]) -> Firing:
    """Run ``action`` after the spec's step (default 1) completes."""
    at_step = spec.get("step", 1)
    firing = Firing(spec.text)

    def hook(rank: int, step: int) -> None:
        if step == at_step:
            firing.fire()  # before it acts: a hang that ends, or a crash caught by the scenario, was still reached
            action()

    ctx.step_hooks.append(hook)
    return firing


def install_hang(spec: FaultSpec, ctx: Any) -> Firing:
    seconds = spec.get("seconds", 3600.0)
    return _after_step(spec, ctx, lambda: time.sleep(seconds))


def _crash_now(how: str) -> None:
    if how == "exit":
        os._exit(17)
    if how == "abort":
        os.abort()
    raise RuntimeError("injected crash (fault 'crash')")


def install_crash(spec: FaultSpec, ctx: Any) -> Firing:
    how = spec.get("how", "raise")
    return _after_step(spec, ctx, lambda: _crash_now(how))


def install_teardown_abort(spec: FaultSpec, ctx: Any) -> Firing:
    """Its counter is not counted: it acts after the results are delivered (KINDS says it need not fire)."""
    ctx.teardown_hooks.append(os.abort)
    return Firing(spec.text, counted=False)
