"""``gpuregress list`` and ``prune``'s pieces (cli/references.py), called directly: a reference's row from its two
JSON files (a damaged one as such), the table, the names the installed scenarios read, the unread folders, and the
command a listing prune prints to delete what it listed. tests/cli/test_cli.py and test_cli_prune.py run them
through the command line."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.cli.references import HEADER, _row, _table, list_references, prune, read_names, unread

PLATFORM = "cpu-gloo-w2-fp32"
CPU_FINGERPRINT = {"versions": {"torch": "2.13.0", "transformers": "5.24.0"},
                   "device": {"kind": "cpu", "cpu_model": "Xeon", "cpu_capability": "AVX512"}}


def reference(root: Path, name: str, record: Any = None, platform: str = PLATFORM,
              recorded_at: str = "2026-03-04T05:06:07.891011") -> Path:
    """A reference folder with its manifest and (unless ``record`` is None) its record.json."""
    folder = root / name / platform
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"recorded_at": recorded_at}))
    if record is not None:
        (folder / "record.json").write_text(json.dumps(record))
    return folder


def test_a_references_row_names_when_and_by_which_stack_it_was_recorded(tmp_path: Path) -> None:
    """Scenario, platform, the minute it was recorded, its steps (the losses stored), and torch, transformers and
    the CPU with its kernel set, or a GPU by name."""
    cpu = reference(tmp_path, "fsdp", {"series": {"loss": [5.5, 5.1, 4.8]}, "fingerprint": CPU_FINGERPRINT})
    assert _row(cpu) == ("fsdp", PLATFORM, "2026-03-04 05:06", "3",
                         "torch 2.13.0, transformers 5.24.0; Xeon [AVX512]")
    gpu = reference(tmp_path, "fsdp", {"series": {"loss": [1.0]}, "fingerprint": {
        "versions": {"torch": "2.13.0"}, "device": {"kind": "cuda", "name": "NVIDIA H100"}}},
        platform="cuda-sm_90-nccl-w8-bf16")
    assert _row(gpu)[3:] == ("1", "torch 2.13.0, transformers ?; NVIDIA H100")


def test_a_damaged_or_strange_reference_is_a_row_too(tmp_path: Path) -> None:
    """A missing record.json is named by its error; a record that is no JSON object lists no steps or stack."""
    missing = reference(tmp_path, "fsdp")
    assert _row(missing) == ("fsdp", PLATFORM, "-", "-", "damaged: FileNotFoundError")
    strange = reference(tmp_path, "lora", record=[1, 2])
    assert _row(strange)[3:] == ("-", "torch ?, transformers ?; ?")


def test_the_table_is_as_wide_as_its_widest_cells_and_lists_an_empty_folder_as_such(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _table([("a", "bb", "c"), ("ccc", "d", "")]) == ["a    bb  c", "ccc  d"]
    assert list_references(argparse.Namespace(folder=str(tmp_path))) == 0
    assert capsys.readouterr().out == f"{tmp_path}: holds no reference\n"
    reference(tmp_path, "fsdp", {"series": {"loss": [5.5]}, "fingerprint": CPU_FINGERPRINT})
    assert list_references(argparse.Namespace(folder=str(tmp_path))) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == list(HEADER) and row.split()[:2] == ["fsdp", PLATFORM]


def test_the_names_read_are_the_scenarios_references_and_each_models(tmp_path: Path) -> None:
    """On the CPU and on GPUs, with the models given: a folder of another name is unread."""
    assert read_names([], tmp_path) == {"checkpoint", "formats", "fsdp", "lora"}
    with_moe = read_names(["tiny-moe"], tmp_path)
    assert {"fsdp-tiny-moe", "lora-tiny-moe", "checkpoint-tiny-moe", "formats-tiny-moe"} <= with_moe
    for name in ("fsdp", "fsdp-tiny-moe", "old-model"):
        reference(tmp_path, name)
    reference(tmp_path, "old-model", platform="cuda-sm_90-nccl-w8-bf16")
    assert [f"{p.parent.name}/{p.name}" for p in unread(tmp_path, read_names([], tmp_path))] == \
        ["fsdp-tiny-moe/cpu-gloo-w2-fp32", "old-model/cpu-gloo-w2-fp32", "old-model/cuda-sm_90-nccl-w8-bf16"]
    assert unread(tmp_path, with_moe | {"old-model"}) == []


def test_a_listing_prune_prints_the_command_that_deletes_exactly_what_it_listed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command repeats the models and names kept, so pasting it deletes the listed references only; after it,
    a name's folder is gone once none of its platforms is left."""
    for name in ("fsdp", "fsdp-tiny-moe", "my-loop", "old-model"):
        reference(tmp_path, name)
    args = argparse.Namespace(folder=str(tmp_path), model=["tiny-moe"], keep=["my-loop"], yes=False)
    assert prune(args) == 0
    *listed, last = capsys.readouterr().out.splitlines()
    assert listed == ["unread: old-model/cpu-gloo-w2-fp32"]
    command = shlex.split(last.split("delete them with: ", 1)[1])
    assert command == ["gpuregress", "prune", str(tmp_path), "--yes", "--model=tiny-moe", "--keep=my-loop"]
    assert (tmp_path / "old-model" / PLATFORM).is_dir()  # listed only
    assert prune(argparse.Namespace(**{**vars(args), "yes": True})) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp", "fsdp-tiny-moe", "my-loop"]
