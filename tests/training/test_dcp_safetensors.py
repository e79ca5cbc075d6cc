"""The resume checkpoint's storage (training/dcp_safetensors.py): DCP through torch's safetensors writer and
reader, so a checkpoint shipped inside a reference holds no pickle and is read without unpickling."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from pytest_gpuregress.training import dcp_safetensors


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as asked
def test_a_checkpoint_is_safetensors_only_and_loads_without_unpickling(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "optim": {"w": {"exp_avg": torch.full((3, 4), 0.5),
                                                                             "step": torch.tensor(7.0)}}}
    dcp_safetensors.save(saved, tmp_path)  # no process group: one process writes everything
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00001-model-00001-of-00001.safetensors"]  # no .metadata
    assert dcp_safetensors.shard_files(tmp_path) == [tmp_path / "shard-00001-model-00001-of-00001.safetensors"]

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the load unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = {"model": {"w": torch.zeros(3, 4)}, "optim": {"w": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(0.0)}}}
    dcp_safetensors.load(loaded, tmp_path)
    assert torch.equal(loaded["model"]["w"], saved["model"]["w"])
    assert torch.equal(loaded["optim"]["w"]["exp_avg"], saved["optim"]["w"]["exp_avg"])
    assert float(loaded["optim"]["w"]["step"]) == 7.0


def test_anything_but_a_tensor_is_refused_before_dcp_could_pickle_it(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"optim\.w\.lr is a float: only tensors go to DCP"):
        dcp_safetensors.save({"optim": {"w": {"lr": 0.1}}}, tmp_path)
    assert dcp_safetensors.unavailable() is None  # this torch has the safetensors storage


def test_a_torch_without_the_safetensors_storage_says_the_resume_case_is_unavailable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.delattr(dcp, "HuggingFaceStorageWriter")
    reason = dcp_safetensors.unavailable()
    assert reason is not None and "has no torch.distributed.checkpoint." in reason
    assert "HuggingFaceStorageWriter/Reader" in reason
