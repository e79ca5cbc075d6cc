"""Quantized checkpoints of the formats scenario: the safetensors reader and writer, bad input, the
mismatch diagnosis and ``gpuregress inspect-fp8``. Files are built with the oracle's quantizers, so
these tests need no ranks."""

from __future__ import annotations

import json
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.cli import main
from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.scenarios.formats import checkpoint, diagnose, oracle, quantize
from pytest_gpuregress.scenarios.formats.catalog import FORMATS, SCHEMES

pytestmark = pytest.mark.cpu_sensitive  # .ci/run runs these again on a lower CPU kernel path

WEIGHT = np.random.default_rng(0).normal(0, 0.02, (16, 80)).astype(np.float32)
PROBE = np.concatenate([np.linspace(-1, 1, 61), [-0.0, -1e-12, 1e-12]]).astype(np.float32).reshape(2, 32)


def write(path: Path, scheme_id: str, quantized: dict[str, quantize.Quantized] | None = None,
          tagged: str | None = None, metadata: dict[str, str] | None = None) -> Path:
    """A checkpoint of WEIGHT and PROBE quantized by ``scheme_id`` (or ``quantized``), tagged as ``tagged``."""
    scheme = SCHEMES[scheme_id]
    fmt = FORMATS[tagged or scheme.element]
    quantized = quantized or {"w": quantize.quantize(WEIGHT, scheme), "probe": quantize.quantize(PROBE, scheme)}
    tensors = [t for name, q in quantized.items() for t in checkpoint.quantized_tensors(name, fmt, q, scheme.block)]
    meta = {**checkpoint.metadata_for(scheme), "element_format": fmt.torch_name, **(metadata or {})}
    checkpoint.write(path, tensors, meta)
    return path


def kinds(path: Path) -> list[str]:
    return [f.kind for f in diagnose.diagnose_file(path).findings]


def test_the_reader_takes_the_safetensors_package_files_and_the_package_takes_ours(tmp_path: Path) -> None:
    import safetensors
    import safetensors.torch
    import torch

    theirs = tmp_path / "theirs.safetensors"
    codes = torch.arange(256, dtype=torch.uint8)
    safetensors.torch.save_file({"w": codes.view(torch.float8_e4m3fn).reshape(16, 16),
                                 "s": codes[:8].clone().view(torch.float8_e8m0fnu),
                                 "p": codes[:4].clone().view(torch.float4_e2m1fn_x2)}, str(theirs), metadata={"a": "b"})
    ckpt = checkpoint.read(theirs)
    assert ckpt.metadata == {"a": "b"} and ckpt.tensors["w"].tag == "F8_E4M3"
    assert ckpt.tensors["w"].codes().reshape(-1).tolist() == list(range(256))
    assert ckpt.tensors["p"].shape == (8,) and ckpt.tensors["p"].codes().tolist() == [0, 0, 1, 0, 2, 0, 3, 0]

    ours = write(tmp_path / "ours.safetensors", "mx_fp4_e2m1fn")
    parsed = dict(safetensors.deserialize(ours.read_bytes()))
    assert parsed["w"]["dtype"] == "F4" and parsed["w"]["shape"] == [16, 80] and parsed["w_scale"]["dtype"] == "F8_E8M0"
    assert checkpoint.read(ours).metadata["block_size"] == "32"


def flavour_of(message: str) -> tuple[str, ...]:
    """(the tag, the format it names, the format the codes are in) of a flavour diagnosis."""
    found = re.search(r"tagged (\w+) \((\w+)\) but written as (\w+)", message)
    assert found is not None, message
    return found.groups()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_clean_file_gives_no_finding(tmp_path: Path, scheme: str) -> None:
    report = diagnose.diagnose_file(write(tmp_path / "clean.safetensors", scheme))
    assert report.tensors == 2 and report.findings == [] and report.notes == []


def test_e4m3fn_data_tagged_fnuz_is_named_with_both_formats_the_factor_and_the_fix(tmp_path: Path) -> None:
    report = diagnose.diagnose_file(write(tmp_path / "f.safetensors", "per_tensor_e4m3fn", tagged="e4m3fnuz"))
    flavour = next(f for f in report.findings if f.kind == "flavour" and f.tensor == "w")
    assert flavour_of(flavour.message) == ("F8_E4M3FNUZ", "e4m3fnuz", "e4m3fn")
    factor = re.search(r"every value is (\S+)x its true value \(factor (\S+)\)", flavour.message)
    assert factor is not None and factor.groups() == ("0.5", "2"), flavour.message
    fix = re.match(r"tag it (\w+); or convert it to (\w+): set 0x80 codes to 0x00", flavour.fix)
    assert fix is not None and fix.groups() == ("F8_E4M3", "e4m3fnuz"), flavour.fix
    assert "fnuz_0x80" in kinds(tmp_path / "f.safetensors")  # the probe's negative zeros read as NaN


def test_fnuz_data_tagged_e4m3fn_is_named_too(tmp_path: Path) -> None:
    report = diagnose.diagnose_file(write(tmp_path / "f.safetensors", "per_tensor_e4m3fnuz", tagged="e4m3fn"))
    flavour = next(f for f in report.findings if f.kind == "flavour")
    assert flavour_of(flavour.message) == ("F8_E4M3", "e4m3fn", "e4m3fnuz") and "2x its true value" in flavour.message
    assert "special_codes" in kinds(tmp_path / "f.safetensors")  # fnuz's ±240 codes are NaN in e4m3fn


def test_a_conversion_that_kept_0x80_is_flagged(tmp_path: Path) -> None:
    def kept(q: quantize.Quantized) -> quantize.Quantized:
        return quantize.Quantized(q.codes, q.scale * np.float32(2), q.amax)  # bytes as they were, scale doubled

    source = SCHEMES["per_tensor_e4m3fn"]
    path = write(tmp_path / "f.safetensors", "per_tensor_e4m3fn_to_fnuz",
                 {"probe": kept(quantize.quantize(PROBE, source))})
    (finding,) = diagnose.diagnose_file(path).findings
    assert finding.kind == "fnuz_0x80" and "2 of 64 codes are 0x80 in e4m3fnuz data" in finding.message
    assert "negative zero in e4m3fn" in finding.message and "set 0x80 codes to 0x00" in finding.fix


def test_scales_computed_with_448_for_fnuz_are_flagged(tmp_path: Path) -> None:
    fnuz = FORMATS["e4m3fnuz"]
    amax = np.float32(np.abs(WEIGHT).max())
    scale = amax / np.float32(448)  # the bug: e4m3fn's maximum; clamped to fnuz's, so no NaN to hint at it
    q = quantize.Quantized(oracle.encode(np.clip(WEIGHT / scale, -240, 240), fnuz), np.asarray(scale), np.asarray(amax))
    (finding,) = diagnose.diagnose_file(write(tmp_path / "f.safetensors", "per_tensor_e4m3fnuz", {"w": q})).findings
    assert finding.kind == "fnuz_scale_448"
    assert "e4m3fn's maximum 448 was used where e4m3fnuz's maximum is 240" in finding.message
    assert "1.867x too large" in finding.message and "amax/240" in finding.fix


@pytest.mark.parametrize(("scheme", "by", "expected"), [
    ("mx_fp8_e4m3fn", 1, "exponent(s) too large"), ("mx_fp4_e2m1fn", 1, "exponent(s) too large"),
    ("mx_fp8_e4m3fn", -1, "scales are too small"),
])
def test_an_mx_scale_off_by_one_exponent_is_flagged(tmp_path: Path, scheme: str, by: int, expected: str) -> None:
    fmt = FORMATS[SCHEMES[scheme].element]
    right = quantize.mx(WEIGHT, fmt, 32)
    shared = right.scale.astype(np.int64) - quantize.E8M0_BIAS + by
    top = np.float32(oracle.limits(fmt).max)
    scaled = np.clip(np.ldexp(quantize.blocks(WEIGHT, 32), -shared[..., None]).astype(np.float32), -top, top)
    codes = oracle.encode(scaled, fmt).reshape(WEIGHT.shape[0], -1)[:, : WEIGHT.shape[1]]
    wrong = quantize.Quantized(codes, (shared + quantize.E8M0_BIAS).astype(np.uint8))
    (finding,) = diagnose.diagnose_file(write(tmp_path / "f.safetensors", scheme, {"w": wrong})).findings
    assert finding.kind == "mx_scale" and expected in finding.message


def test_the_scale_check_needs_the_amax_and_says_so(tmp_path: Path) -> None:
    q = quantize.quantize(WEIGHT, SCHEMES["per_tensor_e4m3fn"])
    path = write(tmp_path / "f.safetensors", "per_tensor_e4m3fn", {"w": quantize.Quantized(q.codes, q.scale)})
    report = diagnose.diagnose_file(path)
    assert report.findings == [] and "no <name>_amax" in report.notes[0]


# --- bad input: clear errors naming the file and the tensor, and nothing unpickled ---------------------------


class _Marker:
    """Unpickling this touches ``path``: the proof that something unpickled the file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (self.path,))


def test_a_pickle_is_refused_without_being_unpickled(tmp_path: Path) -> None:
    path, marker = tmp_path / "model.bin", tmp_path / "UNPICKLED"
    path.write_bytes(pickle.dumps({"w": _Marker(marker)}))
    with pytest.raises(CheckpointProblem, match=r"model\.bin: not a safetensors file.*\n  fix: .*never unpickles"):
        checkpoint.read(path)
    assert not marker.exists()


@pytest.mark.parametrize(("blob", "problem"), [
    (b"abc", "shorter than the 8-byte header length"),
    (struct.pack("<Q", 6) + b"not js", "the header is not JSON"),
    (struct.pack("<Q", 2) + b"{}" + b"x", "cover 0 of the 1 data bytes"),
])
def test_damaged_files_are_clear_errors(tmp_path: Path, blob: bytes, problem: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointProblem, match=problem):
        checkpoint.read(path)


def _rewrite_header(path: Path, change: object) -> None:
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    change(header)  # type: ignore[operator]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + size :])


def test_a_wrong_size_names_the_tensor(tmp_path: Path) -> None:
    path = write(tmp_path / "f.safetensors", "per_tensor_e4m3fn")
    _rewrite_header(path, lambda h: h["w"].update(shape=[16, 81]))
    with pytest.raises(CheckpointProblem, match=r"f\.safetensors, tensor 'w': F8_E4M3 \[16, 81\] needs 1296 bytes"):
        checkpoint.read(path)


def test_a_missing_scale_tensor_names_the_tensor_and_the_file(tmp_path: Path) -> None:
    scheme = SCHEMES["per_tensor_e4m3fn"]
    q = quantize.quantize(WEIGHT, scheme)
    path = tmp_path / "f.safetensors"
    checkpoint.write(path, [checkpoint.stored_codes("w", FORMATS["e4m3fn"], q.codes)], checkpoint.metadata_for(scheme))
    with pytest.raises(CheckpointProblem, match=r"f\.safetensors, tensor 'w': no scale tensor: expected w_scale"):
        diagnose.diagnose_file(path)


def test_a_tag_that_contradicts_the_metadata_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "f.safetensors", "per_tensor_e4m3fn", metadata={"element_format": "float8_e4m3fnuz"})
    with pytest.raises(CheckpointProblem, match=r"tensor 'w': tagged F8_E4M3 \(float8_e4m3fn\) but the metadata says "
                                                r"element_format float8_e4m3fnuz"):
        diagnose.diagnose_file(path)
    mx = write(tmp_path / "mx.safetensors", "mx_fp8_e4m3fn", metadata={"scale_format": "float32"})
    with pytest.raises(CheckpointProblem, match=r"tensor 'w_scale': tagged F8_E8M0 \(float8_e8m0fnu\) but the metadata"):
        diagnose.diagnose_file(mx)


# --- gpuregress inspect-fp8 -----------------------------------------------------------------------------------


def test_inspect_fp8_passes_a_correct_file_and_flags_a_wrong_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good.safetensors", "per_tensor_e4m3fn")
    assert main(["inspect-fp8", str(good)]) == 0
    out = capsys.readouterr().out
    assert "2 quantized tensors (F8_E4M3 x2)" in out and "clean: codes, tags, metadata" in out

    wrong = write(tmp_path / "wrong.safetensors", "per_tensor_e4m3fn", tagged="e4m3fnuz")
    assert main(["inspect-fp8", str(wrong)]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.lstrip().startswith("w: "))
    assert flavour_of(line) == ("F8_E4M3FNUZ", "e4m3fnuz", "e4m3fn") and "(factor 2)" in line
    assert "fix: tag it F8_E4M3" in out and "likewise in 1 more tensors: probe" in out


def test_inspect_fp8_on_a_file_that_is_not_safetensors_exits_2_naming_it(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "weights.pt"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)  # what torch.save writes: a zip of pickles
    assert main(["inspect-fp8", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"gpuregress: {path}: not a safetensors file" in err and "Traceback" not in err
