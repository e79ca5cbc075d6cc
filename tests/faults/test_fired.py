"""faults/fired.py: a Firing counts what its fault changed, and ``patch`` wraps a function only until the rank's
cleanup hooks run (ranks outlive a job), stacked patches coming off in reverse."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from pytest_gpuregress.faults import firing
from pytest_gpuregress.faults.fired import Firing, patch

from .conftest import rank_ctx, uninstall


def test_a_firing_starts_at_zero_and_counts_each_act() -> None:
    """fire() adds one, fire(n) adds n; an uncounted firing still counts but no record reads it."""
    counted, uncounted = Firing("lr_scale"), Firing("teardown_abort", counted=False)
    assert (counted.count, counted.counted) == (0, True)
    counted.fire()
    counted.fire(3)
    uncounted.fire()
    assert counted.count == 4 and uncounted.count == 1
    assert firing.rank_counts([counted, uncounted]) == {"lr_scale": 4}


def plus(amount: int, seen: list[Callable[..., Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper that records the function it was given and adds ``amount`` to its result."""
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        seen.append(original)
        return lambda value: original(value) + amount
    return wrap


def test_patch_wraps_the_original_until_the_cleanup_hooks_put_it_back() -> None:
    """Two patches of one attribute stack (the later outermost) and the hooks restore the very original."""
    def double(value: int) -> int:
        return 2 * value

    owner = SimpleNamespace(double=double)
    ctx = rank_ctx()
    seen: list[Callable[..., Any]] = []
    patch(ctx, owner, "double", plus(1, seen))
    patch(ctx, owner, "double", plus(100, seen))
    assert seen[0] is double and owner.double(5) == 111
    assert len(ctx.cleanup_hooks) == 2
    ctx.cleanup_hooks.pop()()
    assert owner.double(5) == 11
    uninstall(ctx)
    assert owner.double is double and owner.double(5) == 10
