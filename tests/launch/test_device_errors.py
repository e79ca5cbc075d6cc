"""Sticky CUDA/HIP errors retire a rank: the next case gets a fresh process, while an ordinary error keeps the pool."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pytest_gpuregress.errors import RankFailure
from pytest_gpuregress.launch import worker
from pytest_gpuregress.launch.device_errors import sticky_device_error
from pytest_gpuregress.launch.job import Job, RankFiles
from pytest_gpuregress.launch.pool import WorkerPool
from pytest_gpuregress.launch.spawn import SpawnLauncher, sticky_ranks

DSA_HINT = "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"


@pytest.mark.parametrize(("message", "name"), [
    ("CUDA error: an illegal memory access was encountered" + DSA_HINT, "illegal memory access"),
    ("CUDA error: unspecified launch failure" + DSA_HINT, "unspecified launch failure"),
    ("CUDA error: misaligned address" + DSA_HINT, "misaligned address"),
    ("CUDA error: device-side assert triggered" + DSA_HINT, "device-side assert"),
    ("CUDA error: uncorrectable ECC error encountered", "uncorrectable ECC error"),
    ("CUDA error: an illegal instruction was encountered", "illegal instruction"),
    ("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details), cudaErrorIllegalAddress",
     "illegal memory access"),
    ("HIP error: an illegal memory access was encountered", "illegal memory access"),
    ("HIP error: hipErrorIllegalAddress", "illegal memory access"),
    ("HIP error: unspecified launch failure", "unspecified launch failure"),
    ("hipErrorLaunchFailure", "unspecified launch failure"),
    ("HIP error: device-side assert triggered", "device-side assert"),
    ("hipErrorECCNotCorrectable", "uncorrectable ECC error"),
    ("Memory access fault by GPU node-2 (Agent handle: 0x55d0) on address 0x7f. Reason: Page not present",
     "illegal memory access"),
])
def test_sticky_device_errors_are_recognised_in_cuda_and_hip_wording(message: str, name: str) -> None:
    assert sticky_device_error(message) == name


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "HIP out of memory. Tried to allocate 2.00 GiB",
    "CUDA error: invalid argument" + DSA_HINT,  # the hint alone names no device-side assert
    "CUDA error: no kernel image is available for execution on the device",
    "hipErrorInvalidValue",
    "ValueError: shapes do not match",
    "",
])
def test_recoverable_errors_are_not_sticky(message: str) -> None:
    assert sticky_device_error(message) is None


def test_the_launcher_finds_a_sticky_error_wherever_a_rank_reported_it(tmp_path: Path) -> None:
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "record.json").write_text(json.dumps({"results": {"error": "RuntimeError: CUDA error: "
                                                                            "misaligned address"}}))
    RankFiles(tmp_path, 1).error.write_text(json.dumps({"message": "HIP error: hipErrorIllegalAddress"}))
    RankFiles(tmp_path, 2).device_error.write_text("RuntimeError: CUDA driver error: unknown error\n")
    (tmp_path / "rank3").mkdir()
    (tmp_path / "rank3" / "record.json").write_text(json.dumps({"results": {"error": "ValueError: bad shape"}}))
    assert sticky_ranks(tmp_path, 4) == {0: "misaligned address", 1: "illegal memory access",
                                         2: "device unusable after the job"}


def test_a_rank_whose_synchronize_fails_after_the_job_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    def synchronize() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    job = Job(scenario="x:y", config={}, world_size=1, device_kind="cuda", backend="nccl", run_dir=str(tmp_path),
              timeout_s=60)
    assert worker._release_device_memory(job) == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert worker._release_device_memory(Job(**{**job.__dict__, "device_kind": "cpu"})) is None


# A scenario that keeps a device error as a finding, as the collectives and formats scenarios do, or raises it.
SCENARIO = textwrap.dedent('''
    from pytest_gpuregress.reference.record import RunRecord


    def finding(ctx):
        error = ctx.config.get("error", "")
        if ctx.config.get("raise") and ctx.rank == 1:
            raise RuntimeError(error)
        record = RunRecord(scenario="finding", config={}, platform_key="", world_size=ctx.world_size)
        record.results["error"] = error if ctx.rank == 1 else None
        return record
''')


@pytest.mark.slow
@pytest.mark.full_tier  # 26 s of pooled ranks: the classification's unit tests above stay fast
def test_a_sticky_error_gives_the_next_job_fresh_ranks_and_an_ordinary_one_keeps_them(tmp_path: Path) -> None:
    (tmp_path / "finding_scenario.py").write_text(SCENARIO)
    pool = WorkerPool()
    launcher = SpawnLauncher(reuse=True, pool=pool)

    def run(**config: object) -> list[str]:
        job = Job(scenario="finding_scenario:finding", config=dict(config), world_size=2, device_kind="cpu",
                  backend="gloo", run_dir=str(launcher.make_run_dir()), timeout_s=120, cwd=str(tmp_path))
        return launcher.run(job, 120).notes

    def pids() -> list[int]:
        return next(iter(pool.idle.values())).pids

    try:
        run(error="ValueError: shapes do not match")
        first = pids()
        assert not any("sticky" in n for n in run(error="ValueError: shapes do not match"))
        assert pids() == first, "an ordinary error kept as a finding keeps the ranks"
        notes = run(error="RuntimeError: CUDA error: an illegal memory access was encountered")
        assert any("rank 1: illegal memory access" in n and "retired" in n for n in notes), notes
        assert not pool.idle, "a group with a broken device context is not kept"
        run()
        second = pids()
        assert set(second).isdisjoint(first)
        with pytest.raises(RankFailure, match=r"sticky device error \(rank 1: illegal memory access\)"):
            run(error="HIP error: hipErrorIllegalAddress", **{"raise": True})
        run()
        assert set(pids()).isdisjoint(second)
    finally:
        pool.close()
