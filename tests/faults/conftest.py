"""Installing faults on a stand-in rank of this process, and putting every patch back after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from pytest_gpuregress import faults
from pytest_gpuregress.faults.fired import Firing

Install = Callable[..., tuple[list[Firing], SimpleNamespace]]


def rank_ctx(rank: int = 0) -> SimpleNamespace:
    """The parts of a RankContext an installer reads and writes."""
    return SimpleNamespace(rank=rank, world_size=2, device_kind="cpu", cleanup_hooks=[], step_hooks=[], teardown_hooks=[])


def uninstall(ctx: SimpleNamespace) -> None:
    """Run the rank's cleanup hooks, last first, as a rank does after its job; a second call does nothing."""
    while ctx.cleanup_hooks:
        ctx.cleanup_hooks.pop()()


@pytest.fixture
def install_faults() -> Iterator[Install]:
    """``install(*specs, rank=0)`` -> (the counters of the specs this rank installed, its ctx); undone at teardown."""
    installed: list[SimpleNamespace] = []

    def install(*specs: str, rank: int = 0) -> tuple[list[Firing], SimpleNamespace]:
        ctx = rank_ctx(rank)
        installed.append(ctx)
        return faults.install_counted(list(specs), ctx), ctx

    yield install
    for ctx in reversed(installed):
        uninstall(ctx)
