"""scenarios/formats/stack_io.py's checks, each called directly: a tensor the stack handed back against the codec's
file (dtype, shape, bytes; a misread named with both formats and its factor), a file the stack wrote, a wrong block
scale in transformers' layout, an error matched to a known issue or not, and the I/O paths run over one small file,
clean and with a loader that reads e4m3fn bytes as e4m3fnuz. ml_dtypes is the oracle for every code and value."""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from pytest_gpuregress import faults
from pytest_gpuregress.scenarios.formats import checkpoint, stack_io
from pytest_gpuregress.scenarios.formats.catalog import SCHEMES
from pytest_gpuregress.scenarios.formats.stack_io import BLOCK, PathResult, mismatch

VALUES = np.array([0.5, -1.25, 3.0, 0.015625, -448.0, 0.0, 7.5, -0.09375], dtype=np.float32)  # exact in e4m3fn and e5m2
PATHS = ["safetensors", "safe_open", "torch_load", "dcp"]
# The lines stack_io writes, read back into their fields: a misread (the dtypes, both formats, what changed, the fix),
# bytes that differ (how many, where, the two bytes), and a path's report of one call.
MISREAD = re.compile(r"written as (\S+) \((\w+)\), read back as (\S+): the loader reads (\w+) bytes as (\w+), "
                     r"(.+?); (fix: .+)")
BYTES = re.compile(r"(\d+) of (\d+) bytes differ, first at byte (\d+): 0x([0-9A-F]{2}) written, 0x([0-9A-F]{2}) read")
REPORTED = re.compile(r"(\w+): (.+?): (\d+) of (\d+) tensors; first (\S+): (.+)")


def fields(pattern: re.Pattern[str], text: str | None, whole: bool = True) -> tuple[str, ...]:
    found = (pattern.fullmatch if whole else pattern.search)(text or "")
    assert found is not None, text
    return found.groups()


def codes(values: np.ndarray, dtype: type) -> bytes:
    """The oracle's codes of ``values`` in ml_dtypes' ``dtype``."""
    return np.asarray(values, dtype=np.float32).astype(dtype).view(np.uint8).tobytes()


def decoded(data: bytes, dtype: type) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).view(dtype).astype(np.float64)


def e4m3fn(name: str = "w", values: np.ndarray = VALUES) -> checkpoint.Stored:
    return checkpoint.Stored(name, "F8_E4M3", (2, 4), codes(values, ml_dtypes.float8_e4m3fn))


def as_torch(stored: checkpoint.Stored, dtype: torch.dtype) -> torch.Tensor:
    """The file's bytes as the tensor a loader hands back in ``dtype`` (a view: no conversion)."""
    return torch.frombuffer(bytearray(stored.data), dtype=torch.uint8).view(dtype).reshape(stored.shape)


def test_the_tensor_the_file_holds_is_no_mismatch() -> None:
    stored = e4m3fn()
    assert mismatch(stored, as_torch(stored, torch.float8_e4m3fn)) is None
    assert stack_io.native(stored, "cpu").dtype == torch.float8_e4m3fn
    assert stack_io.raw_bytes(stack_io.native(stored, "cpu")) == stored.data


@pytest.mark.parametrize(("tag", "written", "read_as", "fix"), [
    ("F8_E4M3", "e4m3fn", "e4m3fnuz", "fix: convert e4m3fn to e4m3fnuz"),  # an NVIDIA checkpoint read on MI300
    ("F8_E4M3FNUZ", "e4m3fnuz", "e4m3fn", "fix: the loader must hand F8_E4M3FNUZ tensors back as torch.float8_e4m3fnuz"),
])
def test_fp8_bytes_read_as_the_other_vendors_flavour_are_named_with_the_oracles_factor_and_the_fix(
        tag: str, written: str, read_as: str, fix: str) -> None:
    """The same bytes in the other flavour: every value changes by one factor, which ml_dtypes gives, and the fix
    says what the loader must do (the conversion it skipped, or the dtype it must keep)."""
    stored = checkpoint.Stored("w", tag, (2, 4), codes(VALUES / 2, getattr(ml_dtypes, f"float8_{written}")))
    before = decoded(stored.data, getattr(ml_dtypes, f"float8_{written}"))
    after = decoded(stored.data, getattr(ml_dtypes, f"float8_{read_as}"))
    nonzero = before != 0
    (ratio,) = set(after[nonzero] / before[nonzero])
    assert ratio == (0.5 if written == "e4m3fn" else 2.0)
    text = mismatch(stored, as_torch(stored, getattr(torch, f"float8_{read_as}")))
    said = fields(MISREAD, text)
    assert said[:6] == (f"torch.float8_{written}", tag, f"torch.float8_{read_as}", written, read_as,
                        f"every value {ratio:g}x (factor 2)")
    assert said[6].startswith(fix), said[6]


def test_e5m2_bytes_read_as_e4m3fn_change_by_no_single_factor_and_one_code_shows_it() -> None:
    """Another exponent width: no factor; the first moved code is shown with its value in both formats."""
    data = codes(VALUES, ml_dtypes.float8_e5m2)
    stored = checkpoint.Stored("w", "F8_E5M2", (2, 4), data)
    text = mismatch(stored, as_torch(stored, torch.float8_e4m3fn))
    first = data[0]
    e5m2, e4m3 = decoded(data, ml_dtypes.float8_e5m2)[0], decoded(data, ml_dtypes.float8_e4m3fn)[0]
    said = fields(MISREAD, text)
    assert said[3:5] == ("e5m2", "e4m3fn")
    code = re.fullmatch(r"values change by no single factor \(code 0x([0-9A-F]{2}) is (\S+) in e5m2, (\S+) in e4m3fn\)",
                        said[5])
    assert code is not None and code.groups() == (f"{first:02X}", f"{e5m2:g}", f"{e4m3:g}"), said[5]


def test_the_right_dtype_with_scaled_values_is_a_misread_copied_into_the_right_dtype() -> None:
    """Bytes that differ, but every value read back is the written one x 2 by the oracle: the factor is named; one
    wrong byte is only located; a wrong shape is a wrong shape."""
    stored = e4m3fn()
    doubled = checkpoint.Stored("w", "F8_E4M3", (2, 4), codes(VALUES * 2, ml_dtypes.float8_e4m3fn))  # -448 x 2: NaN
    text = mismatch(stored, as_torch(doubled, torch.float8_e4m3fn))
    assert text is not None and text.startswith("7 of 8 bytes differ, first at byte 0")  # 0.0 x 2 is still 0x00
    assert "6 of 6 values read back 2x (factor 2)" in text
    one_wrong = bytearray(stored.data)
    one_wrong[2] ^= 0x01
    text = mismatch(stored, as_torch(checkpoint.Stored("w", "F8_E4M3", (2, 4), bytes(one_wrong)), torch.float8_e4m3fn))
    assert fields(BYTES, text) == ("1", "8", "2", f"{stored.data[2]:02X}", f"{one_wrong[2]:02X}")
    assert mismatch(stored, as_torch(stored, torch.float8_e4m3fn).reshape(4, 2)) == "shape [4, 2], written [2, 4]"


def test_a_file_the_stack_wrote_is_checked_tensor_by_tensor(tmp_path: Path) -> None:
    """Missing, another tag or shape, other bytes: each named; the file the codec itself wrote passes."""
    stored = e4m3fn()
    assert stack_io.file_mismatch(stored, stored) is None
    assert stack_io.file_mismatch(stored, None) == "not in the file it wrote"
    fnuz = checkpoint.Stored("w", "F8_E4M3FNUZ", (2, 4), stored.data)
    tags = re.compile(r"written as (\w+) (\[[\d, ]+\]), the tensor is (\w+) (\[[\d, ]+\])")
    assert fields(tags, stack_io.file_mismatch(stored, fnuz)) == ("F8_E4M3FNUZ", "[2, 4]", "F8_E4M3", "[2, 4]")
    assert stack_io.differing_bytes(b"\x01\x02", b"\x01") == "1 bytes where 2 were written"
    path = tmp_path / "torch_save.pt"
    torch.save({"w": stack_io.native(stored, "cpu")}, path)
    other = e4m3fn(values=-VALUES)
    assert stack_io.archive_mismatch(path, {"w": stored, "v": other}) == {
        "w": None, "v": "its bytes are in no storage of the archive torch.save wrote"}


@pytest.fixture(scope="module")
def blocks() -> stack_io.BlockQuantized:
    weight = np.random.default_rng(0).normal(0, 0.05, (2 * BLOCK, 3 * BLOCK)).astype(np.float32)
    weight[0, 0] = 1.0  # one block with a much larger scale than the others
    return stack_io.block_quantize("model.layers.0.mlp.up_proj.weight", weight)


def test_block_quantized_values_are_the_oracles_code_times_its_blocks_scale(blocks: stack_io.BlockQuantized) -> None:
    """transformers' fine-grained layout: e4m3fn codes, one float32 scale per block, value = code x scale."""
    scales = np.frombuffer(blocks.scales.data, dtype="<f4").reshape(2, 3)
    assert blocks.scales.name.endswith("_scale_inv") and blocks.codes.tag == "F8_E4M3"
    spread = np.kron(scales.astype(np.float64), np.ones((BLOCK, BLOCK)))
    want = (decoded(blocks.codes.data, ml_dtypes.float8_e4m3fn).reshape(2 * BLOCK, 3 * BLOCK) * spread).astype(np.float32)
    assert np.array_equal(blocks.values, want)
    assert len(set(scales.reshape(-1).tolist())) == 6  # every block its own scale


def test_a_wrong_block_scale_or_a_misread_of_the_codes_is_named(blocks: stack_io.BlockQuantized) -> None:
    """Dequantized by a loader: the oracle's values pass; a doubled scale is every value 2x; codes read as e4m3fnuz
    are named as that format; fp8 kept with a wrong scale_inv is refused; a missing weight is missing."""
    name = blocks.codes.name
    assert stack_io.loaded_mismatch(name, blocks, {name: torch.from_numpy(blocks.values)}) is None
    wrong_scale = stack_io.loaded_mismatch(name, blocks, {name: torch.from_numpy(blocks.values * 2)})
    assert wrong_scale is not None and "every value 2x (factor 2)" in wrong_scale
    fnuz = stack_io._dequantized_as(blocks.codes.codes(), blocks, stack_io.FORMATS["e4m3fnuz"])
    misread = stack_io.loaded_mismatch(name, blocks, {name: torch.from_numpy(fnuz)})
    assert fields(re.compile(r"reads (\w+) bytes as (\w+), every value (\S+)x"), misread, whole=False) == \
        ("e4m3fn", "e4m3fnuz", "0.5")
    kept = stack_io.native(blocks.codes, "cpu")
    right = stack_io.native(blocks.scales, "cpu")
    assert stack_io.loaded_mismatch(name, blocks, {name: kept, blocks.scales.name: right}) is None
    assert stack_io.loaded_mismatch(name, blocks, {name: kept, blocks.scales.name: right * 2}) \
        == "its weight_scale_inv is missing or differs from the one written"
    assert stack_io.loaded_mismatch(name, blocks, {}) == "missing"


def test_an_error_of_the_stack_is_a_problem_unless_it_is_a_known_issue_on_the_tags_it_is_about() -> None:
    """torch.load's fp4 failure under deterministic algorithms on a file with F4 tensors is the known issue, by name;
    the same error on an fp8 file, or another error, fails the path; the path goes on after either."""
    fp4 = RuntimeError("\"fill_empty_deterministic_\" not implemented for 'Float4_e2m1fn_x2'")
    out = PathResult("torch_load")
    with out.attempt("mx_fp4_e2m1fn", "torch.load", frozenset({"F4", "F8_E8M0"})):
        raise fp4
    with out.attempt("per_tensor_e4m3fn", "torch.load", frozenset({"F8_E4M3"})):
        raise fp4
    with out.attempt("per_tensor_e4m3fn", "torch.save", frozenset({"F8_E4M3"})):
        raise KeyError("F8_E4M3")
    [issue] = out.known_issues
    assert issue.split(": ")[:2] == ["mx_fp4_e2m1fn", "torch.load"] and "known issue torch-fp4-deterministic " in issue
    assert [p.split(" raised ")[0] for p in out.problems] == ["per_tensor_e4m3fn: torch.load", "per_tensor_e4m3fn: torch.save"]
    assert out.problems[1].endswith("raised KeyError: 'F8_E4M3'")
    result = out.as_dict()
    assert result["library"].startswith("torch ") and result["checked"] == 0 and result["skipped"] is None


def test_a_dcp_failure_is_described_by_the_first_ranks_own_exception() -> None:
    """DCP wraps each rank's exception: the description names the rank and its error, not the wrapper's text."""
    wrapped = Exception("CheckpointException ranks:dict_keys([1, 0])")
    wrapped.failures = {1: ValueError("late"), 0: (TypeError("size mismatch\nmore"), None)}  # type: ignore[attr-defined]
    ranked = re.compile(r"(\w+) \(rank (\d+)\): (\w+): (.*)")
    assert fields(ranked, stack_io.describe_error(wrapped)) == ("Exception", "0", "TypeError", "size mismatch")
    assert stack_io.describe_error(OSError()) == "OSError: "


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, checkpoint.Checkpoint]:
    """The codec's per-tensor e4m3fn file: codes, a float32 scale and an amax, with the scheme's metadata."""
    path = tmp_path_factory.mktemp("codec") / "per_tensor_e4m3fn.safetensors"
    tensors = [e4m3fn("model.w"), checkpoint.stored_float32("model.w_scale", np.array(0.25)),
               checkpoint.stored_float32("model.w_amax", np.array(112.0)),
               checkpoint.Stored("model.b", "F8_E4M3", (8,), codes(VALUES[::-1], ml_dtypes.float8_e4m3fn))]
    checkpoint.write(path, tensors, checkpoint.metadata_for(SCHEMES["per_tensor_e4m3fn"]))
    return {"per_tensor_e4m3fn": checkpoint.read(path)}


@contextlib.contextmanager
def injected(spec: str) -> Iterator[list[faults.Firing]]:
    ctx = types.SimpleNamespace(cleanup_hooks=[], rank=0)
    try:
        yield faults.install_counted([spec], ctx)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()


def test_every_path_passes_a_clean_stack_byte_for_byte(source: dict[str, checkpoint.Checkpoint], tmp_path: Path) -> None:
    """safetensors, safe_open (with its slices), torch.save/load and DCP give back the codec's bytes both ways."""
    results = stack_io.run(PATHS, source, None, "cpu", tmp_path, tmp_path)
    assert list(results) == PATHS
    for path, result in results.items():
        assert (result["problems"], result["known_issues"], result["skipped"]) == ([], [], None), path
        assert result["checked"] > 0, path
    assert results["safe_open"]["checked"] > results["safetensors"]["checked"]  # every slice is checked too
    assert not (tmp_path / "formats-dcp").exists()  # DCP's folders are removed


def test_a_loader_that_reads_e4m3fn_as_e4m3fnuz_fails_its_path_only(source: dict[str, checkpoint.Checkpoint],
                                                                    tmp_path: Path) -> None:
    """The misread inside safetensors' load_file: its path names both formats and the factor for each fp8 tensor of
    the file; the scale and amax (float32) are read right; safe_open, torch.load and DCP stay clean."""
    with injected("format:mode=loader_fn_as_fnuz,path=safetensors") as (firing,):
        results = stack_io.run(PATHS, source, None, "cpu", tmp_path, tmp_path)
    (problem,) = results["safetensors"]["problems"]
    said = fields(REPORTED, problem)
    assert said[:5] == ("per_tensor_e4m3fn", "load_file", "2", "4", "model.w")
    assert fields(MISREAD, said[5])[:5] == ("torch.float8_e4m3fn", "F8_E4M3", "torch.float8_e4m3fnuz", "e4m3fn", "e4m3fnuz")
    assert "factor 2" in problem
    assert firing.count == 2
    assert all(results[path]["problems"] == [] for path in PATHS if path != "safetensors")
