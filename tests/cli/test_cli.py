"""The gpuregress command line, on stored references."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuregress.cli import main
from pytest_gpuregress.reference import store

from ..conftest import make_record


@pytest.fixture
def two_refs(tmp_path: Path) -> tuple[Path, Path]:
    a = store.write_reference(store.ReferenceLocation(tmp_path / "a", "fsdp", "cpu-gloo-w2-fp32"), make_record(),
                              overwrite=False)
    changed = make_record()
    changed.series["loss"][2] += 0.5
    b = store.write_reference(store.ReferenceLocation(tmp_path / "b", "fsdp", "cpu-gloo-w2-fp32"), changed,
                              overwrite=False)
    return a, b


def test_show_summarises_a_reference(two_refs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(two_refs[0])]) == 0
    out = capsys.readouterr().out
    assert "scenario:  fsdp" in out and "platform:  cpu-gloo-w2-fp32 (2 ranks)" in out and "steps:     5" in out


def test_compare_passes_identical_and_fails_different(two_refs: tuple[Path, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(two_refs[0]), str(two_refs[0])]) == 0
    assert main(["compare", str(two_refs[0]), str(two_refs[1])]) == 1
    assert "loss: first differing step 2" in capsys.readouterr().out


def test_corrupt_reference_is_a_clear_error(two_refs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    (two_refs[1] / "record.json").write_text("{}")
    assert main(["show", str(two_refs[1])]) == 2
    assert "record.json: sha256" in capsys.readouterr().err


def test_a_path_that_is_not_there_is_a_typo_not_a_reference_to_re_record(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope'}: no such file or folder" in err and "re-record" not in err
    (tmp_path / "record.json").write_text("{}")
    assert main(["show", str(tmp_path / "record.json")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'record.json'}: not a folder" in err and "holds record.json" in err


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"gpuregress {version('pytest-gpuregress')}"


def test_env_prints_the_fingerprint(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    assert main(["env", "--json", "--device", "cpu"]) == 0
    fingerprint = json.loads(capsys.readouterr().out)
    assert fingerprint["versions"]["torch"] == torch.__version__
    assert fingerprint["comm"]["backend"] == "gloo" and fingerprint["comm"]["world_size"] == 2
    assert fingerprint["device"]["kind"] == "cpu" and fingerprint["device"]["cpu_capability"]
    assert main(["env", "--device", "cpu"]) == 0  # in words by default
    words = capsys.readouterr().out.splitlines()
    assert words[0].startswith(f"stack: torch {torch.__version__}, transformers ")
    assert words[1].startswith("device: cpu ") and "ranks: 2 on gloo" in words
    assert words[-1] == "every field, for machines: gpuregress env --json"


def test_list_shows_each_reference_of_a_folder_with_its_stack_and_a_damaged_one_as_such(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import shutil

    shipped = Path(__file__).resolve().parents[2] / "reference_runs"
    assert main(["list", str(shipped)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["scenario", "platform", "recorded", "steps", "stack"]
    fsdp = next(line for line in lines if line.startswith("fsdp ") and " cpu-gloo-w2-fp32 " in line)
    assert " 300 " in fsdp and "torch 2.13.0" in fsdp
    damaged = tmp_path / "refs"
    shutil.copytree(shipped / "fsdp", damaged / "fsdp")
    (damaged / "fsdp" / "cpu-gloo-w2-fp32" / "record.json").write_text("{")
    assert main(["list", str(damaged)]) == 0
    assert "damaged: JSONDecodeError" in capsys.readouterr().out
    assert main(["list", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_scenarios_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert rows["fsdp"] == "training" and rows["collectives"] == "check"
    assert "`" not in out and "Scenario fsdp:" not in out  # no doc markup, the name said once


def test_plot_draws_the_comparison_of_two_stored_records(two_refs: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp.png"
    assert main(["plot", str(two_refs[0]), str(two_refs[1]), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and f"plot: {out}" in capsys.readouterr().out
    assert main(["plot", str(two_refs[0]), "-o", str(tmp_path / "ref.png")]) == 0  # a reference alone
    assert (tmp_path / "ref.png").is_file()


def test_compare_advises_recording_only_the_judged_case() -> None:
    """Not a bare --gpuregress-record, which now records every built-in case and every test of the project."""
    from types import SimpleNamespace

    from pytest_gpuregress.cli import _record_hint
    from pytest_gpuregress.scenarios import Case, registry

    judged = SimpleNamespace(scenario=registry()["fsdp"], case=Case("resume"))
    assert _record_hint(judged) == "pytest --gpuregress --gpuregress-record gpuregress::fsdp-resume"
    assert "<the test that checks this run>" in _record_hint(SimpleNamespace(scenario=None, case=None))
