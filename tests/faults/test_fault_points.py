"""Fault points: a marked function runs as written until a fault intercepts it, and again once the fault lets go."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_gpuregress.fault_points import POINTS, fault_point, intercept, intercepted


def test_a_point_runs_through_its_interceptors_last_outermost_and_clean_after_undo() -> None:
    @fault_point("formats.format_max")
    def largest(value: float) -> float:
        return value

    def plus(amount: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return lambda original: lambda value: original(value) + amount

    assert largest(1.0) == 1.0
    first, second = intercept("formats.format_max", plus(1)), intercept("formats.format_max", lambda o: lambda v: o(v) * 10)
    assert largest(1.0) == 20.0 and intercepted() == ["formats.format_max"]  # (1 + 1) x 10: the last one outermost
    first()
    assert largest(1.0) == 10.0
    second()
    second()  # an undo run twice does nothing more
    assert largest(1.0) == 1.0 and intercepted() == []


def test_an_unknown_point_is_refused_on_both_sides() -> None:
    with pytest.raises(KeyError, match="no fault point 'formats.decod'"):
        fault_point("formats.decod")
    with pytest.raises(KeyError, match="no fault point 'lora.merge'"):
        intercept("lora.merge", lambda original: original)
    assert "checkpoint.after_load" in POINTS
