"""Where references live (plugin/places.py), on a ReferencePlaces built directly: names that would leave the
folder, --gpuregress-record-missing beside the shipped references, the record command a model and a token file
shape, and the tests that read a reference. tests/plugin/test_session_core.py covers the folders' order."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.errors import UnsafeName
from pytest_gpuregress.option_spec import OptionSpec
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.places import ReferencePlaces, _changed
from pytest_gpuregress.plugin.selection import Selection
from pytest_gpuregress.scenarios import Setup
from pytest_gpuregress.stack.platforms import Platform
from pytest_gpuregress.training.model_specs import parse_model

PLATFORM = "cpu-gloo-w2-fp32"


def places(root: Path, **options: Any) -> ReferencePlaces:
    """The places of a two-rank CPU run under ``root`` (its rootdir) with ``options``."""
    selection = Selection(Setup("cpu", "gloo", 2), Platform("cpu", "gloo", 2, "cpu", "cpu", in_place=False), None, [])
    return ReferencePlaces(Options(enabled=True, device="cpu", **options), root, selection)


@pytest.mark.parametrize("name", ["../escaped", ".hidden", "a/b"])
def test_a_reference_name_that_would_leave_or_hide_in_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    """A ``name=`` given to check() becomes a folder: one that is no single plain component is refused, and not
    noted as read; a plain one is found under the user's folder."""
    where = places(tmp_path, reference_dir=tmp_path / "refs")
    with pytest.raises(UnsafeName, match="reference name"):
        where.location(name, PLATFORM)
    assert name not in where.used
    assert where.location("my-model", PLATFORM).path == tmp_path / "refs" / "my-model" / PLATFORM


def test_record_missing_records_only_where_neither_the_users_nor_the_shipped_folder_has_one(tmp_path: Path) -> None:
    """By default the shipped references are read where the user has none, so a missing reference is one missing
    from both: the shipped CPU fsdp is compared, a GPU platform's is recorded."""
    missing = places(tmp_path, record_missing=True)
    assert not missing.recording("fsdp", PLATFORM)
    assert missing.recording("fsdp", "cuda-sm_90-nccl-w8-bf16")
    assert missing.recording("my-model", PLATFORM)
    assert not places(tmp_path).recording("my-model", PLATFORM)  # comparing: never recorded


def test_the_record_command_names_the_model_and_the_token_file_that_shaped_the_config(tmp_path: Path) -> None:
    """A zoo model by its name, a token file by its path: the printed command records the same setup."""
    tokens = tmp_path / "traffic.npy"
    where = places(tmp_path, models=(parse_model("tiny-moe", tmp_path),), tokens=tokens)
    command = shlex.split(where.record_hint(["gpuregress::fsdp-tiny-moe"]))
    assert command[:4] == ["pytest", "--gpuregress", "--gpuregress-record", "gpuregress::fsdp-tiny-moe"]
    assert {"--gpuregress-model=tiny-moe", f"--gpuregress-tokens={tokens}",
            f"--gpuregress-reference-dir={tmp_path / 'reference_runs'}"} <= set(command)
    assert not any(part.startswith("--gpuregress-steps") for part in command)  # at its default: left out


def test_only_options_off_their_default_are_repeated_and_lists_join_with_commas() -> None:
    """``_changed``: ``--flag=value`` for each option whose value is not its default, a list joined by commas."""
    steps = OptionSpec("steps", "int", None, "training steps")
    targets = OptionSpec("lora-targets", "csv", [], "targets")
    assert _changed([(steps, 8), (targets, ["q_proj", "v_proj"])]) == \
        ["--gpuregress-steps=8", "--gpuregress-lora-targets=q_proj,v_proj"]
    assert _changed([(steps, None), (targets, [])]) == []


def test_the_tests_reading_a_reference_are_the_built_in_cases_then_each_project_test_once(tmp_path: Path) -> None:
    """A project's test that looks a reference up twice is named once, after the built-in cases that read it; a
    built-in case that reads another's reference is not noted, its node id selects it already."""
    where = places(tmp_path)
    where.current_test = "tests/test_mine.py::test_fsdp_too"
    where.location("fsdp", PLATFORM)
    where.location("fsdp", PLATFORM)
    where.current_test = "gpuregress::triage-oracle-fsdp"
    assert where.tests_reading("fsdp") == ["gpuregress::fsdp*", "tests/test_mine.py::test_fsdp_too"]
    assert where.readers == {"fsdp": ["tests/test_mine.py::test_fsdp_too"]}
