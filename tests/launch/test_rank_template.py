"""Fresh ranks forked from a template that has imported torch (launch/template.py): the same bits as ranks that
import for themselves, their deaths reported as Popen would report them, and one template per import-time
environment."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pytest_gpuregress.launch.pool import shared_templates
from pytest_gpuregress.launch.spawn import SpawnLauncher
from pytest_gpuregress.launch.template import DISABLE, ForkedRank, Templates, template_key

from .test_worker_pool import job, same_bits

pytestmark = pytest.mark.slow


def _rank_env() -> dict[str, str]:
    """As pool.rank_environment gives it: one OpenMP thread (with more, torch's import leaves a thread running,
    and the template refuses to fork)."""
    env = {k: v for k, v in os.environ.items() if k != DISABLE}
    return dict(env, OMP_NUM_THREADS="1", GPUREGRESS_PARENT_PID=str(os.getpid()))


def test_forked_ranks_compute_the_bits_of_ranks_that_imported_for_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = SpawnLauncher(reuse=False)
    forked = launcher.run(job(launcher), 120)
    assert any(t.ready for t in shared_templates().by_key.values()), "the ranks were not forked from a template"
    monkeypatch.setenv(DISABLE, "0")
    imported = launcher.run(job(launcher), 120)
    same_bits(forked.records[0], imported.records[0])
    same_bits(forked.records[1], imported.records[1])


def test_a_forked_ranks_exit_code_and_the_signal_that_killed_it_are_reported(tmp_path: Path) -> None:
    templates = Templates()
    env = _rank_env()
    try:
        ranks: list[ForkedRank] = []
        for rank in (0, 1):
            forked = templates.fork(rank, env, tmp_path / f"r{rank}.log")
            assert forked is not None, [t.log.read_text() for t in templates.by_key.values()]
            ranks.append(forked)
        assert len(templates.by_key) == 1, "both ranks come from one template"
        assert all(rank.poll() is None for rank in ranks)
        ranks[0].stdin.close()  # EOF: a rank with no job leaves with 0, as the pool's ranks do
        assert ranks[0].wait(timeout=30) == 0
        os.kill(ranks[1].pid, signal.SIGKILL)
        assert ranks[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        templates.close()


def test_a_rank_whose_template_died_is_reported_killed_not_running(tmp_path: Path) -> None:
    templates = Templates()
    try:
        forked = templates.fork(0, _rank_env(), tmp_path / "r0.log")
        assert forked is not None
        (template,) = templates.by_key.values()
        template.proc.kill()  # the rank dies with it (worker.die_with_parent), and nobody reaps it with a status
        deadline = time.monotonic() + 30
        while forked.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert forked.returncode == -signal.SIGKILL
        assert "forked this rank exited (-9)" in (tmp_path / "r0.log").read_text()
    finally:
        templates.close()


def test_only_variables_read_after_the_imports_may_differ_between_a_template_and_its_ranks() -> None:
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "2"}
    assert template_key(base) == template_key({**base, "RANK": "1", "WORLD_SIZE": "1"})
    for imported_with in ({"PYTHONPATH": "/overlay"}, {"OMP_NUM_THREADS": "2"}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        assert template_key(base) != template_key({**base, **imported_with}), imported_with


def test_ranks_on_a_gpu_never_come_from_a_template(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CUDA/HIP driver touched before a fork is unusable in the child: GPU ranks start as new interpreters."""
    from pytest_gpuregress.launch import pool

    asked: list[int] = []
    monkeypatch.setattr(pool, "shared_templates", lambda: asked.append(1))
    started: list[list[str]] = []
    monkeypatch.setattr(pool.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    gpu_job = job(SpawnLauncher(reuse=False))
    gpu_job.device_kind = "cuda"
    pool.RankGroup(gpu_job, tmp_path)
    assert not asked and len(started) == 2 and started[0][-3:] == ["pytest_gpuregress.launch.worker", "--serve", "0"]


def test_a_template_outlives_many_ranks_ending_at_once(tmp_path: Path) -> None:
    """Ranks of a closed group leave together: their SIGCHLDs interrupt the template's reaper inside itself. The
    template must reap them all, report each, and still fork (a template that died took the running ranks along).
    Their job pipes close here before the ranks open them, as a launch that fails at once closes them: EOF, no hang."""
    templates = Templates()
    try:
        ranks = [templates.fork(rank, _rank_env(), tmp_path / f"r{rank}.log") for rank in range(8)]
        assert all(ranks), [t.log_tail() for t in templates.by_key.values()]
        for rank in ranks:
            rank.stdin.close()  # type: ignore[union-attr]
        assert [rank.wait(timeout=60) for rank in ranks] == [0] * 8  # type: ignore[union-attr]
        (template,) = templates.by_key.values()
        assert template.proc.poll() is None, template.log_tail()
        assert templates.fork(8, _rank_env(), tmp_path / "r8.log") is not None
    finally:
        templates.close()
