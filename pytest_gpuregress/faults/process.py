"""Process-level faults, installed on a rank: hang, crash, or abort at teardown."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from . import FaultSpec


def _after_step(spec: FaultSpec, action: Callable[[], None]) -> Callable[[int, int], None]:
    at_step = spec.get("step", 1)

    def hook(rank: int, step: int) -> None:
        if step == at_step:
            action()

    return hook


def install_hang(spec: FaultSpec, ctx: Any) -> None:
    seconds = spec.get("seconds", 3600.0)
    ctx.step_hooks.append(_after_step(spec, lambda: time.sleep(seconds)))


def _crash_now(how: str) -> None:
    if how == "exit":
        os._exit(17)
    if how == "abort":
        os.abort()
    raise RuntimeError("injected crash (fault 'crash')")


def install_crash(spec: FaultSpec, ctx: Any) -> None:
    how = spec.get("how", "raise")
    ctx.step_hooks.append(_after_step(spec, lambda: _crash_now(how)))


def install_teardown_abort(spec: FaultSpec, ctx: Any) -> None:
    ctx.teardown_hooks.append(os.abort)
