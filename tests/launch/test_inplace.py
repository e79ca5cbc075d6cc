"""launch/inplace.py, torchrun's in-place mode, without torchrun: the rank read from torchrun's environment, a launch
run in this process on a process group of one (records and arrays through the gathers, faults installed and undone),
and how a failing rank tells its peers through the store and leaves later launches refused at once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pytest_gpuregress.errors import RankFailure
from pytest_gpuregress.launch import inplace
from pytest_gpuregress.launch.inplace import InPlaceLauncher, _fail_together
from pytest_gpuregress.launch.job import Job
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.stack.platforms import launched_by_torchrun

ENTRY = f"{__name__}:one_rank"
pytestmark = pytest.mark.usefixtures("torch_state")  # tests/conftest.py: execute_rank sets process-wide determinism


def one_rank(ctx: Any) -> RunRecord:
    """A rank entry: one all-reduce, one silu (what a host_op fault moves), a record with an array."""
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    if ctx.config.get("raise"):
        raise ValueError("boom")
    F.silu(torch.ones(2))
    return RunRecord(scenario="one_rank", config=ctx.config, platform_key="cpu-gloo-w1", world_size=ctx.world_size,
                     series={"loss": [total.item()]}, arrays={"w": np.arange(4, dtype=np.float32)})


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun exports to a rank of a one-rank job."""
    for name in ("LOCAL_RANK", "GPUREGRESS_SPAWNED", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


@pytest.fixture
def group_of_one(tmp_path: Path, torchrun_env: None) -> Iterator[None]:
    """The default process group torchrun's rendezvous would make, at world size 1 (a FileStore, no sockets)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def job(run_dir: Path, **config: Any) -> Job:
    return Job(scenario=ENTRY, config=config, world_size=1, device_kind="cpu", backend="gloo", run_dir=str(run_dir),
               timeout_s=30, faults=["host_op"], collect_fingerprint=False)


def test_the_rank_comes_from_torchrun_environment(monkeypatch: pytest.MonkeyPatch, torchrun_env: None) -> None:
    """RANK and WORLD_SIZE make a run in place; LOCAL_RANK defaults to RANK; only rank 0 writes references."""
    assert launched_by_torchrun()
    launcher = InPlaceLauncher()
    assert (launcher.rank, launcher.local_rank, launcher.is_writer, launcher.launches) == (0, 0, True, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    launcher = InPlaceLauncher()
    assert (launcher.rank, launcher.local_rank, launcher.is_writer) == (5, 1, False)
    run_dir = launcher.make_run_dir()
    assert run_dir.is_dir() and run_dir.name.startswith("gpuregress-rank5-")
    run_dir.rmdir()
    monkeypatch.setenv("GPUREGRESS_SPAWNED", "1")  # a rank our own spawner started is not in place
    assert not launched_by_torchrun()


@pytest.mark.parametrize(("rank", "local_rank", "error"), [(None, None, KeyError), ("two", None, ValueError),
                                                          ("0", "first", ValueError)])
def test_a_rank_environment_that_is_not_torchruns_is_refused(monkeypatch: pytest.MonkeyPatch, rank: str | None,
                                                            local_rank: str | None, error: type[Exception]) -> None:
    """Without RANK there is no rank to be, and a RANK or LOCAL_RANK that is not an integer is no rank either."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(error):
        InPlaceLauncher()


def test_a_launch_runs_in_this_process_and_installs_and_undoes_its_faults(tmp_path: Path, group_of_one: None) -> None:
    """The entry runs as rank 0 on the existing group; its record comes back with the faults' counts, every outcome
    is delivered, and the host_op fault is gone afterwards."""
    silu = F.silu
    launcher = InPlaceLauncher()
    result = launcher.run(job(tmp_path / "run"), wall_timeout_s=60)
    (record,) = result.records
    assert record.series == {"loss": [1.0]} and record.arrays["w"].tolist() == [0, 1, 2, 3]
    assert record.results["faults_fired"] == {"host_op": 1} and "listening" not in record.results  # not loopback-only
    assert [(o.rank, o.status) for o in result.outcomes] == [(0, "delivered")] and result.wall_s > 0
    assert launcher.launches == 1 and launcher.torn_down is None and dist.is_initialized()
    assert F.silu is silu
    result = launcher.run(job(tmp_path / "again"), wall_timeout_s=60)  # the same group serves the next launch
    assert launcher.launches == 2 and result.records[0].series == {"loss": [1.0]}


def test_the_gathers_carry_json_and_arrays_byte_for_byte(group_of_one: None) -> None:
    """Records travel as JSON and safetensors bytes in uint8 tensors: what goes in comes out, one per rank."""
    payload = {"a": [1, 2.5, "x"], "nested": {"k": None}}
    assert inplace._gather_json(payload, "cpu") == [payload]
    arrays = {"w": np.linspace(0, 1, 7), "i": np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2]}
    (back,) = inplace._gather_arrays(arrays, "cpu")
    assert set(back) == {"w", "i"} and np.array_equal(back["w"], arrays["w"]) and back["i"].tolist() == [[0, 2], [3, 5]]


def test_ranks_that_read_other_input_files_are_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each node builds its config from its own files: rank 1 with another token file fails every rank, naming it;
    keys that may differ between nodes (a temporary folder) are not compared."""
    configs = [{"tokens": "a.bin", "model_architecture": "llama"}, {"tokens": "b.bin", "model_architecture": "llama"}]
    monkeypatch.setattr(inplace, "_gather_json", lambda mine, device: configs)
    mine = job(tmp_path, tokens="a.bin", model_architecture="llama", scratch="/tmp/x")
    with pytest.raises(RankFailure, match="rank 1's node reads other files") as failure:
        inplace._agree_on_inputs(mine, 0)
    assert "tokens" in str(failure.value) and "scratch" not in str(failure.value)
    configs[1]["tokens"] = "a.bin"
    inplace._agree_on_inputs(mine, 0)  # agreeing nodes: no error


def test_a_raising_rank_tears_the_group_down_and_later_launches_are_refused(tmp_path: Path, group_of_one: None) -> None:
    """The rank's own error comes back as a RankFailure naming it; the group is gone, so the next launch is refused
    at once, naming the launch that failed, instead of hanging on a second rendezvous."""
    launcher = InPlaceLauncher()
    with pytest.raises(RankFailure, match=r"^rank 0 raised ValueError \(in place") as failure:
        launcher.run(job(tmp_path / "run", **{"raise": True}), wall_timeout_s=60)
    assert "boom" in str(failure.value)
    assert not dist.is_initialized() and launcher.torn_down is not None and "launch 1" in launcher.torn_down
    with pytest.raises(RankFailure, match="^not run: launch 1 "):
        launcher.run(job(tmp_path / "next"), wall_timeout_s=60)
    assert launcher.launches == 1


def test_the_first_rank_to_fail_posts_its_error_and_the_others_report_it() -> None:
    """Through the store: rank 1 fails first and reports its own error; rank 0, failing as a consequence, reports
    rank 1's; a store that is gone leaves each rank its own error."""
    store = dist.HashStore()
    key = "gpuregress/launch-1/failed"
    first = _fail_together(store, key, 1, ValueError("bad shard"))
    assert str(first).startswith("rank 1 raised ValueError")
    assert json.loads(store.get(key).decode())["rank"] == 1
    second = str(_fail_together(store, key, 0, RuntimeError("connection reset")))
    assert second.startswith("rank 1 raised ValueError: bad shard") and "rank 0 stopped with RuntimeError" in second

    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("store closed")

    assert str(_fail_together(Gone(), key, 0, KeyError("x"))).startswith("rank 0 raised KeyError")
