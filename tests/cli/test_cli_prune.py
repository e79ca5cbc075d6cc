"""``gpuregress prune``: the references a folder holds that no case reads are listed, and deleted with --yes;
those of the given models and the names kept stay; the shipped references are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuregress.cli import main
from pytest_gpuregress.resources import shipped_dir


def reference(root: Path, name: str, platform: str = "cpu-gloo-w2-fp32") -> Path:
    folder = root / name / platform
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def test_unread_references_are_listed_then_deleted_and_read_ones_stay(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("fsdp", "lora", "fsdp-tiny-moe", "fsdp-removed-model", "my-loop"):
        reference(tmp_path, name)
    reference(tmp_path, "fsdp", "cuda-nccl-w8-bf16")
    assert main(["prune", str(tmp_path), "--keep=my-loop"]) == 0
    out = capsys.readouterr().out
    assert "unread: fsdp-removed-model/cpu-gloo-w2-fp32" in out and "unread: fsdp-tiny-moe/" in out
    assert "unread: fsdp/" not in out and "my-loop" not in out.split("delete them")[0]
    assert (tmp_path / "fsdp-removed-model").is_dir()  # listed only
    assert main(["prune", str(tmp_path), "--keep=my-loop", "--model=tiny-moe", "--yes"]) == 0
    assert "deleted: fsdp-removed-model/cpu-gloo-w2-fp32" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp", "fsdp-tiny-moe", "lora", "my-loop"]


def test_the_shipped_references_and_a_missing_folder_are_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(shipped_dir("reference_runs"))]) != 0
    assert "not yours to prune" in capsys.readouterr().err
    assert main(["prune", str(tmp_path / "nowhere")]) != 0
    assert "no such folder" in capsys.readouterr().err
