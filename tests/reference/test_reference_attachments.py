"""Folders a reference keeps beside its record (RunRecord.attachments: the fsdp resume checkpoint): stored with the
reference, every file in the manifest, and a damaged, missing or slipped-in file refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpuregress.errors import CorruptReference
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.record import RunRecord


@pytest.fixture
def loc(tmp_path: Path) -> store.ReferenceLocation:
    return store.ReferenceLocation(tmp_path / "refs", "fsdp", "cpu-gloo-w2-fp32", "RECORD-HINT")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "made-by-ranks"
    (folder / "tensors").mkdir(parents=True)
    (folder / "tensors" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"shard one")
    (folder / "trainer.json").write_text('{"step": 4}\n')
    return folder


def test_an_attachment_is_stored_listed_and_found_again(loc: store.ReferenceLocation, record: RunRecord,
                                                        checkpoint: Path) -> None:
    record.attachments = {"resume": checkpoint}
    store.write_reference(loc, record, overwrite=False)
    listed = json.loads((loc.path / store.MANIFEST).read_text())["files"]
    assert sorted(listed) == ["record.json", "resume/tensors/shard-00001-model-00001-of-00001.safetensors",
                              "resume/trainer.json", "tensors.safetensors"]
    back = store.read_reference(loc)
    assert back.attachments == {"resume": loc.path / "resume"}
    assert (back.attachments["resume"] / "trainer.json").read_text() == '{"step": 4}\n'
    assert "resume" not in json.loads((loc.path / "record.json").read_text())  # the record itself is unchanged


def test_a_reference_without_attachments_reads_as_before(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    assert sorted(json.loads((loc.path / store.MANIFEST).read_text())["files"]) == ["record.json", "tensors.safetensors"]
    assert store.read_reference(loc).attachments == {}


@pytest.mark.parametrize(("damage", "named", "why"), [
    (lambda p: (p / "resume" / "trainer.json").write_text('{"step": 5}\n'), "resume/trainer.json",
     "does not match manifest.json"),
    (lambda p: (p / "resume" / "trainer.json").unlink(), "resume/trainer.json", "listed in manifest.json is missing"),
    (lambda p: (p / "resume" / "tensors" / "shard-00002-model-00001-of-00001.safetensors").write_bytes(b"x"),
     "resume/tensors/shard-00002-model-00001-of-00001.safetensors", "not listed in manifest.json"),
])
def test_a_damaged_attachment_is_refused_naming_the_file(loc: store.ReferenceLocation, record: RunRecord,
                                                         checkpoint: Path, damage: object, named: str, why: str) -> None:
    record.attachments = {"resume": checkpoint}
    store.write_reference(loc, record, overwrite=False)
    damage(loc.path)  # type: ignore[operator]
    with pytest.raises(CorruptReference) as info:
        store.read_reference(loc)
    assert str(loc.path / named) in str(info.value) and why in str(info.value) and "RECORD-HINT" in str(info.value)


@pytest.mark.parametrize("entry", ["../outside.json", "resume/../../x", "stray.json", "/abs/path"])
def test_a_manifest_entry_outside_an_attachment_folder_is_refused(loc: store.ReferenceLocation, record: RunRecord,
                                                                  entry: str) -> None:
    store.write_reference(loc, record, overwrite=False)
    manifest = loc.path / store.MANIFEST
    data = json.loads(manifest.read_text())
    data["files"][entry] = "0" * 64
    manifest.write_text(json.dumps(data))
    with pytest.raises(CorruptReference, match="manifest lists the wrong files"):
        store.read_reference(loc)


def test_an_attachment_may_not_take_a_reference_files_name(loc: store.ReferenceLocation, record: RunRecord,
                                                           checkpoint: Path) -> None:
    record.attachments = {"record.json": checkpoint}
    with pytest.raises(ValueError, match="record.json"):
        store.write_reference(loc, record, overwrite=False)
    assert not loc.path.exists()  # nothing half-written
