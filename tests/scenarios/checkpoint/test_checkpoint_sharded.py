"""The checkpoint scenario's sharded checkpoints (scenarios/checkpoint/sharded.py): DCP's own format, saved whole or
not at all, and checked complete before a load, naming the shard file that is missing or cut short."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.scenarios.checkpoint import sharded

pytestmark = pytest.mark.usefixtures("one_rank_group")

NAMES = ("a", "b", "c", "d", "e")


def state(fill: float | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Five small tensors under "model" (seeded values, or ``fill`` everywhere): every one in rank 0's shard."""
    generator = torch.Generator().manual_seed(0)
    return {"model": {name: torch.full((4, 3), fill) if fill is not None else torch.randn(4, 3, generator=generator)
                      for name in NAMES}}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    sharded.save(state(), folder)
    return folder


def shard_of(folder: Path) -> Path:
    [shard] = [p for p in folder.iterdir() if p.name != sharded.METADATA]
    return shard


def test_a_save_loads_back_and_leaves_no_staging_folder(saved: Path) -> None:
    """The round trip restores every tensor; the staging folder is swapped in, nothing is left beside it."""
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]
    assert (saved / sharded.METADATA).is_file()
    sharded.verify(saved)  # complete: no exception
    loaded = state(fill=0.0)
    sharded.load(loaded, saved, saved_world=1)
    for name in NAMES:
        assert torch.equal(loaded["model"][name], state()["model"][name]), name


def test_a_second_save_replaces_the_folder_whole(saved: Path) -> None:
    """What the old folder held (a stray file) does not survive: a reader sees one save, never a mix."""
    (saved / "stray").write_text("old")
    sharded.save(state(fill=2.0), saved)
    assert not (saved / "stray").exists()
    loaded = state(fill=0.0)
    sharded.load(loaded, saved, saved_world=1)
    assert all(torch.equal(t, torch.full((4, 3), 2.0)) for t in loaded["model"].values())


def test_a_tensor_the_checkpoint_lacks_is_a_checkpoint_problem_not_a_crash(saved: Path) -> None:
    """DCP refuses a load that asks for a tensor the save never wrote with a CheckpointException, a BaseException the
    scenario's ``except`` would miss: it comes back as a CheckpointProblem naming the folder and the tensor."""
    wants_more = state(fill=0.0)
    wants_more["model"]["f"] = torch.zeros(4, 3)
    with pytest.raises(CheckpointProblem) as refused:
        sharded.load(wants_more, saved, saved_world=1)
    assert str(saved) in str(refused.value) and "model.f" in str(refused.value)


def test_a_missing_shard_is_named_with_the_tensors_it_held(saved: Path) -> None:
    """Deleting the shard file: verify names that file, the number of tensors whose chunks it held, and three."""
    shard = shard_of(saved)
    shard.unlink()
    with pytest.raises(CheckpointProblem) as caught:
        sharded.verify(saved)
    assert caught.value.path == str(shard)
    assert caught.value.problem.startswith("missing")
    assert "5 tensors" in caught.value.problem and "and 2 more" in caught.value.problem
    assert "model.a, model.b, model.c" in caught.value.problem


def test_a_truncated_shard_is_refused_before_dcp_reads_it(saved: Path) -> None:
    """A shard cut short: the load stops at verify, names the file and its size, and leaves the state untouched."""
    shard = shard_of(saved)
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    loaded = state(fill=0.0)
    with pytest.raises(CheckpointProblem) as caught:
        sharded.load(loaded, saved, saved_world=1)
    assert caught.value.path == str(shard)
    assert caught.value.problem.startswith(f"truncated: {size // 2} bytes")
    assert all(torch.equal(t, torch.zeros(4, 3)) for t in loaded["model"].values())


def test_a_folder_without_metadata_is_not_a_checkpoint(saved: Path) -> None:
    """No .metadata: the save never finished; the problem names the folder."""
    (saved / sharded.METADATA).unlink()
    with pytest.raises(CheckpointProblem) as caught:
        sharded.verify(saved)
    assert caught.value.path == str(saved)
    assert caught.value.problem.startswith(f"no {sharded.METADATA}")


def test_anything_but_tensors_is_refused_before_a_file_is_written(tmp_path: Path) -> None:
    """DCP would pickle a float: the save refuses it and writes nothing, not even a staging folder."""
    with pytest.raises(TypeError, match=r"model\.lr is a float"):
        sharded.save({"model": {"lr": 0.1}}, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
