"""Process faults (faults/process.py): hang and crash act after the step the spec names and nowhere else, counting
before they act; teardown_abort leaves an abort for teardown that no record counts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pytest_gpuregress.faults import parse, process

from .conftest import Install, rank_ctx


def test_hang_sleeps_after_its_step_only(install_faults: Install) -> None:
    """``hang:step=2`` does nothing after steps 0 and 1, then sleeps its seconds after step 2, counted once."""
    (firing,), ctx = install_faults("hang:step=2,seconds=0.2")
    (hook,) = ctx.step_hooks
    started = time.monotonic()
    hook(0, 0)
    hook(0, 1)
    assert firing.count == 0 and time.monotonic() - started < 0.15
    hook(0, 2)
    assert firing.count == 1 and time.monotonic() - started >= 0.2


def test_a_raising_crash_fires_at_its_step_default_1(install_faults: Install) -> None:
    """``crash`` raises after step 1 (the default step); its firing counts before it raises."""
    (firing,), ctx = install_faults("crash")
    (hook,) = ctx.step_hooks
    hook(0, 0)
    hook(0, 2)
    assert firing.count == 0
    with pytest.raises(RuntimeError, match="injected crash"):
        hook(0, 1)
    assert firing.count == 1


def test_process_faults_install_only_on_the_ranks_they_name(install_faults: Install) -> None:
    """A hang, crash or abort for rank 1 leaves rank 0 with no hook at all."""
    firings, ctx = install_faults("hang:rank=1", "crash:rank=1", "teardown_abort:rank=1", rank=0)
    assert firings == [] and ctx.step_hooks == [] and ctx.teardown_hooks == []
    firings, ctx = install_faults("hang:rank=1", "crash:rank=1", "teardown_abort:rank=1", rank=1)
    assert [f.spec for f in firings] == ["hang:rank=1", "crash:rank=1", "teardown_abort:rank=1"]
    assert len(ctx.step_hooks) == 2 and ctx.teardown_hooks == [os.abort]


def test_teardown_abort_is_not_counted() -> None:
    """It acts after the results are delivered, so its firing says it cannot be counted."""
    ctx = rank_ctx()
    firing = process.install_teardown_abort(parse("teardown_abort"), ctx)
    assert ctx.teardown_hooks == [os.abort] and ctx.step_hooks == [] and ctx.cleanup_hooks == []
    assert (firing.spec, firing.counted, firing.count) == ("teardown_abort", False, 0)


RANK = """
import sys
from types import SimpleNamespace
from pytest_gpuregress import faults
ctx = SimpleNamespace(rank=0, world_size=1, device_kind="cpu", cleanup_hooks=[], step_hooks=[], teardown_hooks=[])
faults.install_counted([sys.argv[1]], ctx)
for step in range(3):
    print("completed step", step, flush=True)
    for hook in ctx.step_hooks:  # after each completed step, as a trainer calls them
        hook(0, step)
for hook in ctx.teardown_hooks:
    hook()
"""


def no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@pytest.mark.parametrize(("spec", "returncode", "steps"), [
    ("crash:how=exit", 17, 2),  # after step 1, the default,
    ("crash:how=abort,step=0", -signal.SIGABRT, 1),
    ("teardown_abort", -signal.SIGABRT, 3),
    ("hang:step=9", 0, 3),  # a step the run never reaches: the rank runs to the end
])
def test_a_rank_process_ends_where_the_fault_says(spec: str, returncode: int, steps: int) -> None:
    """In a rank process of its own: how it ends (exit 17, SIGABRT) and after how many completed steps."""
    done = subprocess.run([sys.executable, "-c", RANK, spec], capture_output=True, text=True, timeout=60,
                          preexec_fn=no_core_dump, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == returncode, done.stderr
    assert done.stdout.splitlines() == [f"completed step {s}" for s in range(steps)]
