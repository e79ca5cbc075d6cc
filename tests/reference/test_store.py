"""The reference store: atomic writes, no silent overwrite, clear errors for bad references."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.errors import CorruptReference, ForeignReference, MissingReference, ReferenceExists
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.record import RunRecord

from ..conftest import make_record


@pytest.fixture
def loc(tmp_path: Path) -> store.ReferenceLocation:
    return store.ReferenceLocation(tmp_path / "refs", "fsdp", "cpu-gloo-w2-fp32", "RECORD-HINT")


def test_round_trip_is_exact(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    back = store.read_reference(loc)
    assert back.series == record.series
    assert back.config == record.config and back.digests == record.digests
    for key, value in record.arrays.items():
        assert back.arrays[key].dtype == value.dtype
        np.testing.assert_array_equal(back.arrays[key], value)
    # nothing but the reference itself is left behind
    assert sorted(p.name for p in loc.path.parent.iterdir()) == ["cpu-gloo-w2-fp32"]
    assert sorted(p.name for p in loc.path.iterdir()) == ["manifest.json", "record.json", "tensors.safetensors"]


def test_never_overwrites_without_the_flag(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    before = (loc.path / "record.json").read_bytes()
    with pytest.raises(ReferenceExists, match="--gpuregress-record"):
        store.write_reference(loc, make_record(seed=1), overwrite=False)
    assert (loc.path / "record.json").read_bytes() == before
    store.write_reference(loc, make_record(seed=1), overwrite=True)
    assert (loc.path / "record.json").read_bytes() != before


def test_missing_reference_names_path_and_command(loc: store.ReferenceLocation) -> None:
    with pytest.raises(MissingReference) as info:
        store.read_reference(loc)
    assert str(loc.path) in str(info.value) and "RECORD-HINT" in str(info.value)


def test_a_missing_reference_says_a_reference_of_another_world_size_is_beside_it(tmp_path: Path,
                                                                                   record: RunRecord) -> None:
    def at(key: str) -> store.ReferenceLocation:
        return store.ReferenceLocation(tmp_path / "refs", "lora", key, "RECORD-HINT")

    store.write_reference(at("cpu-gloo-w2-fp32-fsdp2"), record, overwrite=False)
    store.write_reference(at("cpu-gloo-w1-fp32-accelerate"), record, overwrite=False)  # another wrapper: not said
    with pytest.raises(MissingReference) as info:
        store.read_reference(at("cpu-gloo-w1-fp32-fsdp2"))
    assert "no reference recorded for scenario 'lora' on platform 'cpu-gloo-w1-fp32-fsdp2'; the same folder holds " \
           "cpu-gloo-w2-fp32-fsdp2 (--gpuregress-world-size=2 compares with it)" in str(info.value)
    with pytest.raises(MissingReference) as alone:
        store.read_reference(at("cpu-gloo-w1-fp32-other"))
    assert "the same folder holds" not in str(alone.value)


def test_truncated_tensors_are_named(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    tensors = loc.path / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(CorruptReference, match="tensors.safetensors.*truncated, edited"):
        store.read_reference(loc)


def test_edited_json_is_named(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    path = loc.path / "record.json"
    path.write_text(path.read_text().replace('"lr": 0.003', '"lr": 0.004'))
    with pytest.raises(CorruptReference, match="record.json: sha256"):
        store.read_reference(loc)


def test_garbage_manifest_is_named(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    (loc.path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptReference, match="manifest.json: not valid JSON"):
        store.read_reference(loc)


def test_foreign_manifest_format_is_named(loc: store.ReferenceLocation, record: RunRecord) -> None:
    store.write_reference(loc, record, overwrite=False)
    (loc.path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CorruptReference, match="not a pytest-gpuregress reference"):
        store.read_reference(loc)


class _Payload:
    """Unpickling this creates the file named in ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def test_pickle_is_never_loaded(loc: store.ReferenceLocation, record: RunRecord, tmp_path: Path) -> None:
    """A malicious pickle where safetensors belongs is rejected as corrupt, never executed."""
    import pickle

    marker = tmp_path / "pwned"
    store.write_reference(loc, record, overwrite=False)
    tensors = loc.path / "tensors.safetensors"
    tensors.write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest = json.loads((loc.path / "manifest.json").read_text())
    from pytest_gpuregress.reference.atomic import sha256_file

    manifest["files"]["tensors.safetensors"] = sha256_file(tensors)
    (loc.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptReference, match="not a readable safetensors file"):
        store.read_reference(loc)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world_size": 4}, "world size: reference 2, this run 4"),
        ({"config": {"steps": 5, "lr": 3e-3, "dtype": "fp32", "model": "other"}}, "config model"),
        ({"scenario": "lora"}, "scenario: reference 'fsdp', this run 'lora'"),
    ],
)
def test_foreign_reference_is_refused(loc: store.ReferenceLocation, record: RunRecord, change: dict,
                                      message: str) -> None:
    store.write_reference(loc, record, overwrite=False)
    reference = store.read_reference(loc)
    with pytest.raises(ForeignReference, match=message) as info:
        store.check_compatible(loc, reference, make_record(**change))
    assert "record.json" in str(info.value)


def test_config_differences_name_each_key_and_ignore_where_inputs_live() -> None:
    from pytest_gpuregress.reference.store import config_differences

    a = {"lr": 0.1, "tokens": {"file": "/a/t.npy", "sha256": "x"}, "model_file": "/a/m.json"}
    b = {"lr": 0.2, "tokens": {"file": "/b/t.npy", "sha256": "y"}, "model_file": "/b/m.json", "extra": 1}
    assert config_differences(a, b, ("rank 0", "rank 1")) == [
        "config extra: rank 0 '<absent>', rank 1 1", "config lr: rank 0 0.1, rank 1 0.2",
        "config tokens.sha256: rank 0 'x', rank 1 'y'"]
    assert config_differences(a, {**a, "model_file": "/elsewhere.json"}) == []
