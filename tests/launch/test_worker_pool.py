"""The worker pool: ranks reused across launches give the same bits, and broken ranks are replaced.

Launches go through the real launcher and real gloo ranks, with few steps. The pooled results are
compared bitwise with a launch in a group of its own, after scenarios and faults that patch global
state (torch.distributed collectives, F.linear, optimizer hooks) ran in the same processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.errors import RankFailure
from pytest_gpuregress.launch.job import Job
from pytest_gpuregress.launch.pool import WorkerPool
from pytest_gpuregress.launch.spawn import SpawnLauncher
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import get_scenario
from pytest_gpuregress.scenarios.base import Setup

from ..conftest import FSDP_ONLY

pytestmark = pytest.mark.slow

CPU = Setup("cpu", "gloo", 2, steps=6)


def job(launcher: SpawnLauncher, scenario: str = "fsdp", faults: tuple[str, ...] = (),
        **config: Any) -> Job:
    sc = get_scenario(scenario)
    return Job(scenario=sc.rank_entry, config={**sc.default_config(CPU), **config}, world_size=2,
               device_kind="cpu", backend="gloo", run_dir=str(launcher.make_run_dir()), timeout_s=120,
               faults=list(faults))


def same_bits(a: RunRecord, b: RunRecord) -> None:
    assert a.series == b.series
    assert set(a.arrays) == set(b.arrays)
    for key, value in a.arrays.items():
        assert value.tobytes() == b.arrays[key].tobytes(), key
    assert {k: v["sha256"] for k, v in a.digests.items()} == {k: v["sha256"] for k, v in b.digests.items()}


@pytest.fixture(scope="module")
def module_pool() -> Any:
    """One pool for this module's tests (its own: nothing shared with other test files); each test
    counts only the groups its own launcher starts."""
    pool = WorkerPool()
    yield pool
    pool.close()


@pytest.fixture
def pooled(module_pool: WorkerPool) -> SpawnLauncher:
    return SpawnLauncher(reuse=True, pool=module_pool)


@pytest.mark.full_tier  # about 35 s: the fast tier keeps the pool's replacement tests
def test_a_scenario_gives_the_same_bits_alone_or_after_others_in_reused_ranks(pooled: SpawnLauncher) -> None:
    fresh = SpawnLauncher(reuse=False)
    alone = fresh.run(job(fresh), 120).records[0]
    # Faults that patch collectives, F.linear and the optimizer, then another scenario, then fsdp again.
    pooled.run(job(pooled, faults=("collective:op=reduce_scatter,rel=1e-3", "linear_noise:rel=1e-6",
                                   "lr_scale:factor=1.5")), 120)
    pooled.run(job(pooled, "lora", wrapper="fsdp2"), 120)
    after_others = pooled.run(job(pooled), 120).records[0]
    assert pooled.groups_started <= 1, "every launch should have reused one group of ranks"
    same_bits(alone, after_others)


POLLUTER = """
import os

import torch


def pollute(ctx):
    # What a careless user scenario does to a process: another default dtype, flushed denormals,
    # an environment variable, a disabled SDPA backend.
    torch.set_default_dtype(torch.float64)
    torch.set_flush_denormal(True)
    os.environ["LOCAL_WORLD_SIZE"] = "99"
    torch.backends.cuda.enable_math_sdp(False)
    from pytest_gpuregress.reference.record import RunRecord

    return RunRecord(scenario="polluter", config={}, platform_key="", world_size=ctx.world_size)
"""


@pytest.mark.full_tier  # 53 s of pooled jobs: the fast tier stays within its time
def test_process_wide_state_a_job_changed_is_back_for_the_next_job(pooled: SpawnLauncher, tmp_path: Path) -> None:
    fresh = SpawnLauncher(reuse=False)
    alone = fresh.run(job(fresh, "lora", wrapper="accelerate"), 120).records[0]
    (tmp_path / "polluter.py").write_text(POLLUTER)
    polluting = job(pooled)
    polluting.scenario, polluting.cwd = "polluter:pollute", str(tmp_path)
    pooled.run(polluting, 120)
    pooled.run(job(pooled, "lora", wrapper="accelerate"), 120)  # accelerate's singletons, built once
    after = pooled.run(job(pooled, "lora", wrapper="accelerate"), 120).records[0]
    assert pooled.groups_started <= 1
    same_bits(alone, after)


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_a_rank_that_failed_is_replaced_and_the_next_launch_gets_a_fresh_group(pooled: SpawnLauncher) -> None:
    pooled.run(job(pooled), 120)
    first, started = list(pooled.pool.idle.values())[0].pids, pooled.groups_started
    with pytest.raises(RankFailure, match="rank 1 raised RuntimeError"):
        pooled.run(job(pooled, faults=("crash:rank=1,step=1",)), 120)
    assert not pooled.pool.idle, "a group with a failed rank must not be kept"
    for pid in first:  # the whole group is gone, not only the rank that raised
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    record = pooled.run(job(pooled), 120).records[0]
    assert record.series["loss"], "the launch after a failure runs on a fresh group"
    second = list(pooled.pool.idle.values())[0].pids
    assert set(second).isdisjoint(first)
    assert pooled.groups_started == started + 1


@pytest.mark.full_tier  # about 18 s; a rank that failed in a launch is replaced in the fast tier
def test_an_idle_rank_killed_between_launches_is_replaced(pooled: SpawnLauncher) -> None:
    pooled.run(job(pooled), 120)
    group, started = list(pooled.pool.idle.values())[0], pooled.groups_started
    os.kill(group.pids[1], signal.SIGKILL)
    group.procs[1].wait()
    assert pooled.run(job(pooled), 120).records[0].series["loss"]
    assert pooled.groups_started == started + 1


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_a_hung_rank_is_reported_and_its_group_replaced(pooled: SpawnLauncher) -> None:
    with pytest.raises(RankFailure, match="rank 1 hung") as failure:
        pooled.run(job(pooled, faults=("hang:rank=1,step=1",)), 8)
    started = pooled.groups_started
    assert "step 1 done" in str(failure.value)  # the hung rank's last progress
    assert pooled.run(job(pooled), 120).records[0].series["loss"]
    assert pooled.groups_started == started + 1


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every process's parent and command line (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        found[int(entry.name)] = (int(stat.split(")")[-1].split()[1]), cmdline)
    return found


def _children_serving(parent: int) -> list[int]:
    """Rank processes of the launcher ``parent``: started by it, or forked by a template it started (template.py)."""
    processes = _processes()
    templates = {pid for pid, (ppid, cmd) in processes.items()
                 if ppid == parent and b"pytest_gpuregress.launch.template" in cmd}
    return [pid for pid, (ppid, cmd) in processes.items()
            if (ppid == parent and b"pytest_gpuregress.launch.worker" in cmd) or ppid in templates]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _is_zombie(pid)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the ranks")
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.full_tier), signal.SIGKILL],
                         ids=["SIGTERM", "SIGKILL"])  # SIGTERM in the full tier: the fast tier's 8 minutes
def test_no_rank_outlives_a_cancelled_pytest_run(tmp_path: Path, sig: signal.Signals) -> None:
    """What a CI cancel does: signal pytest while a rank hangs; nothing of the run may survive."""
    (tmp_path / "conftest.py").write_text("")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "-k", FSDP_ONLY,
         "--gpuregress-steps=4", "--gpuregress-inject=hang:rank=1,step=1", "--gpuregress-timeout=300",
         f"--gpuregress-reference-dir={tmp_path / 'refs'}", "--gpuregress-record", "--gpuregress-replicas=0"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(ranks) < 2:
        time.sleep(0.5)
        ranks = _children_serving(proc.pid)
    assert len(ranks) == 2, "the run never started its two ranks"
    time.sleep(5)  # let the ranks import torch and reach the hang
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
        time.sleep(0.2)
    survivors = [pid for pid in ranks if _alive(pid)]
    assert not survivors, textwrap.shorten(f"ranks {survivors} outlived pytest after {sig.name}", 200)


def test_inline_pytest_sessions_share_the_process_pool(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """pytester's inline runs drop the modules they imported; the ranks must not pile up across them."""
    from pytest_gpuregress.launch.pool import MAX_IDLE_GROUPS

    from ..scenarios.test_training_e2e import USER_SCENARIO, USER_TEST

    pytester.makepyfile(user_scenario=USER_SCENARIO, test_user=USER_TEST)
    args = ["-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={tmp_path}", "-k", "my_loop",
            "test_user.py", "--gpuregress-record"]
    # Ranks of this process that earlier tests' launchers still hold are not the inline sessions' to count.
    before = len(_children_serving(os.getpid()))
    counts = []
    for _ in range(3):
        pytester.runpytest(*args).assert_outcomes(passed=1)
        counts.append(len(_children_serving(os.getpid())) - before)
    assert counts[0] == counts[1] == counts[2] <= 2 * MAX_IDLE_GROUPS, counts


@pytest.mark.full_tier  # 28 s of pooled jobs: the fast tier stays within its time
def test_a_job_that_asks_for_fresh_ranks_gets_new_processes_and_leaves_the_pool_alone(pooled: SpawnLauncher) -> None:
    pooled.run(job(pooled), 120)
    pooled_pids, started = list(pooled.pool.idle.values())[0].pids, pooled.groups_started
    fresh = job(pooled)
    fresh.fresh_ranks = True
    assert pooled.run(fresh, 120).records[0].series["loss"]
    assert list(pooled.pool.idle.values())[0].pids == pooled_pids  # the pooled group stays, unused
    assert pooled.groups_started == started + 1
