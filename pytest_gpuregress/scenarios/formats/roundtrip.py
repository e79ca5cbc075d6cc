"""The quantized-checkpoint round trip on one rank. Rank side.

The tiny model's 2-D weights and a probe tensor are quantized on the device per scheme, written as safetensors,
read back, dequantized and used for logits. The record gets closed-form problems against the oracle, float64
checksums (math.fsum: no summation order moves them), logits and the file's diagnosis. Files are temporary.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import GpuRegressError
from . import checkpoint, device, diagnose, oracle, quantize
from .catalog import FORMATS, IO_SCHEMES, SCHEMES, Format, Scheme

PROBE = "gpuregress.probe"


def probe_values() -> np.ndarray:
    """A spread of values with -0.0 and negatives that round to -0, so every checkpoint holds e4m3fn's
    0x80 code and a conversion that skips its rewrite shows whatever the model's weights are."""
    values = np.concatenate([np.linspace(-1.0, 1.0, 61), [-0.0, -1e-12, 1e-12]])
    return values.astype(np.float32).reshape(2, 32)


def batch(shape: tuple[int, int], vocab: int, dev: str) -> torch.Tensor:
    b, t = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    return torch.from_numpy((b * 31 + t * 7 + 3) % vocab).to(dev)


def quantize_on_device(w: torch.Tensor, scheme: Scheme) -> quantize.Quantized:
    """The device's quantization, through ``device``'s functions (which faults replace)."""
    fmt = FORMATS[scheme.element]
    if scheme.source:
        source = quantize_on_device(w, SCHEMES[scheme.source])
        codes, scale = device.fn_to_fnuz(torch.from_numpy(source.codes).to(w.device),
                                         torch.from_numpy(source.scale).to(w.device))
        return quantize.Quantized(codes.cpu().numpy(), scale.cpu().numpy(), source.amax)
    top = device.format_max(fmt)
    if scheme.block:
        rows, cols = w.shape
        grouped = torch.nn.functional.pad(w, (0, -cols % scheme.block)).reshape(rows, -1, scheme.block)
        shared = device.mx_scale_exponent(grouped.abs().amax(dim=-1), fmt)
        scaled = torch.ldexp(grouped, -shared[..., None]).clamp(-top, top)
        codes = device.cast(scaled, fmt).reshape(rows, -1)[:, :cols]
        return quantize.Quantized(codes.cpu().numpy(), (shared + quantize.E8M0_BIAS).to(torch.uint8).cpu().numpy())
    amax = w.abs().max()
    scale = amax / top if amax > 0 else torch.ones_like(amax)
    codes = device.cast((w / scale).clamp(-top, top), fmt)
    return quantize.Quantized(codes.cpu().numpy(), scale.cpu().numpy(), amax.cpu().numpy())


def read_codes(stored: checkpoint.Stored, fmt: Format, dev: str) -> torch.Tensor:
    """The stored bytes as uint8 codes on the device; fp4 unpacked there, from float4_e2m1fn_x2."""
    raw = torch.frombuffer(bytearray(stored.data), dtype=torch.uint8).to(dev)
    if fmt.packed:
        raw = device.unpack_fp4(raw.view(torch.float4_e2m1fn_x2))
    return raw.reshape(stored.shape)


def dequantize_on_device(entry: checkpoint.Entry, codes: torch.Tensor) -> torch.Tensor:
    values = device.decode(codes, entry.fmt)
    if entry.block:
        factors = device.decode(torch.from_numpy(np.array(entry.scale, dtype=np.uint8)).to(codes.device), device.E8M0)
        return values * factors.repeat_interleave(entry.block, dim=-1)[..., : values.shape[-1]]
    return values * torch.tensor(float(entry.scale), dtype=torch.float32, device=codes.device)


def _grouped(problems: dict[str, list[str]], total: int) -> list[str]:
    """One line per kind of problem: how many tensors, and the first one's detail."""
    return [f"{kind} in {len(details)} of {total} tensors; first {details[0]}" for kind, details in problems.items()]


def check_codes(name: str, got: quantize.Quantized, want: quantize.Quantized, scheme: Scheme,
                problems: dict[str, list[str]]) -> None:
    """The device's codes and scales against the oracle's quantization of the same float32 weights."""
    _check_scales(name, got, want, scheme, problems)
    fmt = FORMATS[scheme.element]
    wrong = ~oracle.same_codes(want.codes, got.codes, fmt)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        pairs = {(int(a), int(b)) for a, b in zip(want.codes[wrong], got.codes[wrong])}
        why = ""
        if scheme.source and pairs == {(0x00, 0x80)}:
            source = FORMATS[SCHEMES[scheme.source].element]
            why = (f": 0x80 kept where the conversion writes 0x00 (negative zero in {source.id}, NaN in {fmt.id}): "
                   "the 0x80 rewrite was skipped")
        problems.setdefault("codes differ from the oracle's round-to-nearest-even", []).append(
            f"{name}: {int(wrong.sum())} of {wrong.size} codes, first at flat index {i}: oracle "
            f"0x{int(want.codes.reshape(-1)[i]):02X}, device 0x{int(got.codes.reshape(-1)[i]):02X}{why}")


def _check_scales(name: str, got: quantize.Quantized, want: quantize.Quantized, scheme: Scheme,
                  problems: dict[str, list[str]]) -> None:
    """The device's block exponents (MX) or per-tensor scale against the oracle's."""
    if scheme.block:
        offsets = got.scale.astype(np.int64) - want.scale.astype(np.int64)
        if offsets.any():
            shown = ", ".join(f"{int(o):+d}" for o in np.unique(offsets[offsets != 0]))
            problems.setdefault("e8m0 block scales off the oracle's OCP floor rule", []).append(
                f"{name}: {int((offsets != 0).sum())} of {offsets.size} blocks off by {shown} exponent(s)")
    elif got.scale.tobytes() != want.scale.tobytes():
        amax = float(want.amax) if want.amax is not None else float("nan")
        problems.setdefault("per-tensor scales differ from the oracle's", []).append(
            f"{name}: scale {float(got.scale)!r}, the oracle's {float(want.scale)!r}; the device's is "
            f"amax/{amax / float(got.scale):.6g}, the oracle's amax/{amax / float(want.scale):.6g}")


def check_reading(entry: checkpoint.Entry, codes: torch.Tensor, values: np.ndarray,
                  problems: dict[str, list[str]]) -> None:
    """The device's dequantization of the file against the oracle's (an exact product rounded once)."""
    expected = entry.dequantize().astype(np.float32)
    wrong = ~oracle.same_values(expected, values)
    if not wrong.any():
        return
    decoded = device.decode(codes, entry.fmt).cpu().numpy()
    read_as = oracle.identify(entry.codes, decoded, entry.fmt)
    i = int(np.flatnonzero(wrong)[0])
    detail = (f"{entry.name}: {int(wrong.sum())} of {wrong.size} values, first at flat index {i}: oracle "
              f"{float(expected.reshape(-1)[i])!r}, device {float(values.reshape(-1)[i])!r}")
    if read_as is not None:
        ratio = oracle.value_ratio(oracle.decode(entry.codes, entry.fmt), decoded)
        detail += (f"; the device reads these {entry.tag} bytes as {read_as.id}, not {entry.fmt.id}: every value "
                   f"{ratio:g}x (factor {max(ratio, 1 / ratio):g})" if ratio else f"; read as {read_as.id}")
    problems.setdefault("dequantized on the device unlike the oracle", []).append(detail)


def check_conversion(name: str, converted: np.ndarray, source: np.ndarray, problems: dict[str, list[str]]) -> None:
    """Converting a checkpoint must not change any value (fnuz code x 2 scale == fn code x scale)."""
    changed = ~oracle.same_values(converted.astype(np.float32), source.astype(np.float32))
    changed &= ~((converted == 0) & (source == 0))  # -0.0 becoming 0.0 is the point of the rewrite
    if changed.any():
        nans = int((changed & np.isnan(converted)).sum())
        problems.setdefault("values changed by the conversion", []).append(
            f"{name}: {int(changed.sum())} of {changed.size} values ({nans} became NaN: e4m3fn's negative zero 0x80 "
            "is NaN in e4m3fnuz)")


def checksum(values: np.ndarray) -> dict[str, float]:
    v = oracle.as_float64(values).reshape(-1)
    if not np.isfinite(v).all():  # fsum refuses inf - inf; NaN and inf are findings anyway
        return {"sum": float(v.sum()), "abs_sum": float(np.abs(v).sum())}
    return {"sum": math.fsum(v.tolist()), "abs_sum": math.fsum(np.abs(v).tolist())}


def _needed(selected: list[str]) -> Iterator[Scheme]:
    """The selected schemes of catalog.SCHEMES in catalog order, with the schemes they convert from."""
    wanted = set(selected) | {SCHEMES[s].source for s in selected if s in SCHEMES and SCHEMES[s].source}
    return (s for s in SCHEMES.values() if s.id in wanted)


class RoundTrip:
    """The model, its weights and the fixed batch on one device; ``scheme()`` runs one scheme."""

    def __init__(self, config: dict[str, Any], dev: str, folder: Path) -> None:
        from ...training.models import blueprint, build_causal_lm

        model_config = blueprint(config)
        self.dev, self.folder = dev, folder
        self.model = build_causal_lm(model_config, seed=int(config["seed"])).to(dev).eval()
        self.weights = {n: p.detach() for n, p in self.model.named_parameters() if p.ndim == 2}
        self.weights[PROBE] = torch.from_numpy(probe_values()).to(dev)
        self.ids = batch(tuple(config["batch"]), model_config.vocab_size, dev)
        self.fp32_logits = self.logits({})
        self.exact: dict[str, dict[str, np.ndarray]] = {}  # scheme -> tensor -> the file's exact values

    def logits(self, params: dict[str, torch.Tensor]) -> np.ndarray:
        with torch.no_grad():
            out = torch.func.functional_call(self.model, params, args=(), kwargs={"input_ids": self.ids})
        return out.logits.float().cpu().numpy()

    def write(self, scheme: Scheme, problems: dict[str, list[str]] | None = None) -> checkpoint.Checkpoint:
        """Quantize on the device, check against the oracle's quantizer, write atomically, read back. Without
        ``problems``, a checkpoint for the io cases only (catalog.IO_SCHEMES), quantized by the oracle."""
        fmt = FORMATS[scheme.element]
        tensors = []
        for name, w in self.weights.items():
            got = want = quantize.quantize(w.cpu().numpy(), scheme)
            if problems is not None:
                got = quantize_on_device(w, scheme)
                check_codes(name, got, want, scheme, problems)
            tensors += checkpoint.quantized_tensors(name, fmt, got, scheme.block)
        path = self.folder / f"{scheme.id}.safetensors"
        checkpoint.write(path, tensors, checkpoint.metadata_for(scheme))
        return checkpoint.read(path)

    def scheme(self, scheme: Scheme) -> tuple[dict[str, Any], dict[str, Any], np.ndarray]:
        """(results, diagnosis, logits) of one scheme."""
        problems: dict[str, list[str]] = {}
        ckpt = self.write(scheme, problems)
        dequantized, sums, exact = {}, {}, {}
        for entry in checkpoint.entries(ckpt):
            codes = read_codes(ckpt.tensors[entry.name], entry.fmt, self.dev)
            dequantized[entry.name] = on_device = dequantize_on_device(entry, codes)
            values = on_device.cpu().numpy()
            check_reading(entry, codes, values, problems)
            exact[entry.name] = entry.dequantize()
            if scheme.source:
                check_conversion(entry.name, exact[entry.name], self.exact[scheme.source][entry.name], problems)
            raw = ckpt.tensors[entry.name].data + ckpt.tensors[entry.name + checkpoint.SCALE].data
            sums[entry.name] = {**checksum(values), "sha256": hashlib.sha256(raw).hexdigest()}
        self.exact[scheme.id] = exact
        report = diagnose.diagnose(ckpt)
        logits = self.logits({n: t for n, t in dequantized.items() if n != PROBE})
        deviation = np.abs(oracle.as_float64(logits) - self.fp32_logits).max() / np.abs(self.fp32_logits).max()
        result = {"element_format": FORMATS[scheme.element].torch_name, "block": scheme.block,
                  "file_bytes": ckpt.path.stat().st_size, "problems": _grouped(problems, len(self.weights)),
                  "tensors": sums, "deviation_from_fp32": float(deviation),
                  "logits": {**checksum(logits), "sha256": hashlib.sha256(logits.tobytes()).hexdigest()}}
        return result, {"findings": report.grouped(), "notes": report.notes}, logits


def run(selected: list[str], config: dict[str, Any], dev: str, workdir: Path, progress: Callable[[str], None],
        io_paths: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """(results per scheme, diagnosis per scheme, logits arrays, stack I/O results per path) for the ``selected``
    scheme ids; ``io_paths``: the stack's I/O paths (catalog.IO_PATHS) to put every written file through. Ids of
    catalog.IO_SCHEMES among ``selected`` only add the oracle's checkpoint of that scheme to the io paths' files.

    A scheme whose round trip raises is a finding of its own case, not a crash of the launch."""
    results: dict[str, Any] = {}
    inspected: dict[str, Any] = {}
    io: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="formats-", dir=workdir) as folder:
        trip = RoundTrip(config, dev, Path(folder))
        arrays = {"logits/fp32": trip.fp32_logits}
        for scheme in _needed(selected):
            try:
                results[scheme.id], inspected[scheme.id], arrays[f"logits/{scheme.id}"] = trip.scheme(scheme)
            except (RuntimeError, ValueError, GpuRegressError) as exc:  # a missing kernel, a file it cannot read
                results[scheme.id] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            progress(f"quantized {scheme.id}")
        if io_paths:
            from . import stack_io

            written = {s: checkpoint.read(Path(folder) / f"{s}.safetensors") for s in results if "error" not in results[s]}
            written.update({s: trip.write(IO_SCHEMES[s]) for s in IO_SCHEMES if s in selected})
            io = stack_io.run(io_paths, written, trip.model, dev, Path(folder), workdir)
            progress("stack I/O paths done")
    return results, inspected, arrays, io
