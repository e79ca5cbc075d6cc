"""scenarios/shared/safetensors_file.py: the strict codec reads what the safetensors package writes, and refuses
a pickle or a damaged file naming the file and the tensor, never unpickling it."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.scenarios.shared import safetensors_file as codec


def test_files_round_trip_with_the_safetensors_package_both_ways(tmp_path: Path) -> None:
    theirs = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, dtype=np.float16)}
    save_file(theirs, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    read = codec.read(tmp_path / "theirs.safetensors")
    assert read.metadata == {"format": "pt"}
    assert {n: t.tag for n, t in read.tensors.items()} == {"w": "F32", "b": "F16"}
    np.testing.assert_array_equal(read.tensors["w"].floats(), theirs["w"])

    codec.write(tmp_path / "ours.safetensors", list(read.tensors.values()), read.metadata)
    back = load_file(tmp_path / "ours.safetensors")
    np.testing.assert_array_equal(back["w"], theirs["w"])
    np.testing.assert_array_equal(back["b"], theirs["b"])


def test_fp4_codes_pack_two_to_a_byte_low_nibble_first() -> None:
    codes = np.array([[1, 2, 15, 0]], dtype=np.uint8)
    assert codec.pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    np.testing.assert_array_equal(codec.unpack_nibbles(codec.pack_nibbles(codes)), codes)
    with pytest.raises(ValueError, match="in pairs"):
        codec.pack_nibbles(np.zeros((1, 3), dtype=np.uint8))


def test_a_pickle_is_refused_as_no_safetensors_file_without_being_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    with pytest.raises(CheckpointProblem, match="never unpickles") as caught:
        codec.read(path)
    assert caught.value.tensor is None and str(path) in str(caught.value)


def _file(header: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(("header", "data", "tensor", "problem"), [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), "w", "needs 8 bytes"),
    ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "w", "unknown dtype tag"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 40]}}, bytes(4), "w", "past the end"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), "b", "overlap or leave a gap"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(12), None, "trailing bytes"),
    ({"__metadata__": {"step": 3}}, b"", None, "map names to strings"),
])
def test_a_damaged_file_names_its_tensor_and_what_is_wrong(tmp_path: Path, header: dict[str, object], data: bytes,
                                                            tensor: str | None, problem: str) -> None:
    with pytest.raises(CheckpointProblem, match=problem) as caught:
        codec.parse(_file(header, data), tmp_path / "x.safetensors")
    assert caught.value.tensor == tensor
