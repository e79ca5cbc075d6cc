"""Before any rank starts (plugin/settings_check.py): a selected training case whose stored reference was recorded
with other steps, or in another format, stops the run with the options that fix it; a missing explicit folder
too. Each reference here is its record.json and manifest only: nothing trains."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.plugin.settings_check import differing_settings, missing_folder, usage_message
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.record import RECORD_FORMAT, RECORD_JSON, RERECORD

PLATFORM = "cpu-gloo-w2-fp32"
LORA_PLATFORM = "cpu-gloo-w2-fp32-fsdp2"  # lora-fully_shard's: its wrapper is in its platform tag
CPU_STEPS = 300  # the fsdp scenario's steps on the CPU when --gpuregress-steps is not given


def session(root: Path, *cases: tuple[str, str], **options: Any) -> GpuRegressSession:
    """A CPU session reading ``root/refs`` with ``cases`` (scenario, case id) selected, as -k leaves them."""
    options.setdefault("reference_dir", root / "refs")
    core = GpuRegressSession(Options(enabled=True, device="cpu", **options), root, output_dir=root / "artifacts")
    core.selection.select(set(cases))
    return core


def stored(root: Path, name: str, record: dict[str, Any] | str, platform: str = PLATFORM) -> Path:
    """A reference folder under ``root/refs`` holding ``record`` as its record.json; its path."""
    folder = root / "refs" / name / platform
    folder.mkdir(parents=True)
    (folder / store.MANIFEST).write_text("{}")
    (folder / RECORD_JSON).write_text(record if isinstance(record, str) else json.dumps(record))
    return folder / RECORD_JSON


def recorded_with(steps: int, fmt: str = RECORD_FORMAT) -> dict[str, Any]:
    return {"format": fmt, "config": {"steps": steps, "dtype": "fp32"}}


def test_a_reference_of_other_steps_stops_the_run_with_the_options_that_match_it(tmp_path: Path) -> None:
    """fsdp's plain and resume cases share one reference: one line names it, its steps and this run's, and the
    option that reproduces its settings; the second choice records this run's settings into a folder of its own."""
    path = stored(tmp_path, "fsdp", recorded_with(100))
    core = session(tmp_path, ("fsdp", "fsdp"), ("fsdp", "resume"))
    lines, selections = differing_settings(core)
    assert lines == [f"{path} was recorded with steps 100 (this run {CPU_STEPS}): compare with it by adding "
                     "--gpuregress-steps=100"]
    assert selections == ["gpuregress::fsdp*"]
    message = usage_message(core)
    assert message is not None and lines[0] in message.splitlines()[1]
    hint = shlex.split(message.rsplit("their own: ", 1)[1])
    assert hint[:4] == ["pytest", "--gpuregress", "--gpuregress-record", "gpuregress::fsdp*"]
    assert f"--gpuregress-reference-dir={tmp_path / 'refs-this-stack'}" in hint


def test_a_reference_of_this_runs_settings_passes(tmp_path: Path) -> None:
    """The same steps, given or by default, and nothing is said."""
    stored(tmp_path, "fsdp", recorded_with(100))
    assert usage_message(session(tmp_path, ("fsdp", "fsdp"), steps=100)) is None
    stored(tmp_path, "lora", recorded_with(CPU_STEPS), platform=LORA_PLATFORM)
    assert usage_message(session(tmp_path, ("lora", "fully_shard"))) is None


def test_a_reference_of_another_format_is_refused_with_the_command_that_re_records_it(tmp_path: Path) -> None:
    path = stored(tmp_path, "fsdp", recorded_with(CPU_STEPS, fmt="gpuregress-record/1"))
    (line,), _ = differing_settings(session(tmp_path, ("fsdp", "fsdp")))
    assert line.startswith(f"{path} was recorded in format 'gpuregress-record/1'") and line.endswith(RERECORD)


def test_only_references_this_run_compares_with_are_checked(tmp_path: Path) -> None:
    """A recording run compares with none; a missing or damaged record.json is left to the full read after the run;
    a check scenario's reference is not a training one; an unselected case's reference is not read."""
    stored(tmp_path, "fsdp", recorded_with(100))
    stored(tmp_path, "formats", recorded_with(100, fmt="gpuregress-record/1"))  # a check's config has no steps
    stored(tmp_path, "lora", "{", platform=LORA_PLATFORM)
    assert usage_message(session(tmp_path, ("fsdp", "fsdp"), record=True)) is None
    assert differing_settings(session(tmp_path, ("fsdp", "bf16"))) == ([], [])  # its bf16 platform has none
    assert differing_settings(session(tmp_path, ("lora", "fully_shard"))) == ([], [])
    assert differing_settings(session(tmp_path, ("formats", "behaviour-e4m3fn"))) == ([], [])
    assert differing_settings(session(tmp_path)) == ([], [])


def test_record_missing_still_checks_the_references_that_exist(tmp_path: Path) -> None:
    """--gpuregress-record-missing compares where a reference exists: its settings are checked too."""
    stored(tmp_path, "fsdp", recorded_with(100))
    (line,), _ = differing_settings(session(tmp_path, ("fsdp", "fsdp"), record_missing=True))
    assert line.endswith("--gpuregress-steps=100")


@pytest.mark.parametrize(("options", "refused"), [
    ({}, True), ({"record": True}, False), ({"record_missing": True}, False), ({"reference_dir": None}, False)])
def test_an_explicit_folder_that_does_not_exist_is_refused_only_while_comparing(
        tmp_path: Path, options: dict[str, Any], refused: bool) -> None:
    """A comparing run never creates --gpuregress-reference-dir: a missing one would fail every case after
    training. Recording creates it; without the option the default folder may be absent (the shipped ones read)."""
    core = session(tmp_path, **{"reference_dir": tmp_path / "nowhere", **options})
    message = missing_folder(core)
    assert (message is not None) == refused
    if refused:
        assert message is not None and message.startswith(f"--gpuregress-reference-dir={tmp_path / 'nowhere'}: ")
    (tmp_path / "nowhere").mkdir()
    assert missing_folder(core) is None
