"""Mismatch diagnosis of a quantized safetensors file: do the codes mean what their tags say? torch-free.

Per tensor: NaN or inf codes, 0x80 in fnuz data, fn/fnuz flavour read from the stored amax (factor 2), 448
used where 240 applies, and MX scales against the OCP floor rule (docs/formats.md). A clean file gives no
finding; bad input raises CheckpointProblem.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from . import checkpoint, oracle
from .catalog import FORMATS, Format
from .checkpoint import Entry

# Every block saturating is a too-small MX scale only past this many blocks: a correct scale makes a
# block saturate with odds of 0.19 (e4m3fn: log2(512/448)) or 0.42 (e2m1fn: log2(8/6)), so 16 in a
# row is 3e-12 or 1e-6 by chance.
SATURATED_BLOCKS_MIN = 16


DiagnosisKind = Literal["special_codes", "fnuz_0x80", "flavour", "fnuz_scale_448", "scale_mismatch", "mx_scale"]


@dataclass(frozen=True)
class Diagnosis:
    tensor: str
    kind: DiagnosisKind
    message: str
    fix: str

    def text(self) -> str:
        return f"{self.tensor}: {self.message}\n    fix: {self.fix}"


@dataclass
class Report:
    path: Path
    tags: Counter[str]
    findings: list[Diagnosis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def tensors(self) -> int:
        return sum(self.tags.values())

    def grouped(self, names: int = 6) -> list[str]:
        """One text per kind of finding: the first tensor's in full, then which others have it too."""
        kinds: dict[str, list[Diagnosis]] = {}
        for finding in self.findings:
            kinds.setdefault(finding.kind, []).append(finding)
        out = []
        for found in kinds.values():
            text, others = found[0].text(), [f.tensor for f in found[1:]]
            if others:
                more = f" and {len(others) - names} more" if len(others) > names else ""
                text += f"\n    likewise in {len(others)} more tensors: {', '.join(others[:names])}{more}"
            out.append(text)
        return out


def diagnose_file(path: Path) -> Report:
    return diagnose(checkpoint.read(path))


def diagnose(ckpt: checkpoint.Checkpoint) -> Report:
    found = checkpoint.entries(ckpt)
    report = Report(ckpt.path, Counter(e.tag for e in found))
    without_amax = 0
    for entry in found:
        report.findings += special_codes(entry)
        if entry.block:
            report.findings += mx_scales(entry)
        elif entry.amax is None:
            without_amax += 1
        else:
            report.findings += per_tensor_scale(entry)
    if without_amax:
        report.notes.append(f"{without_amax} per-tensor scales have no <name>_amax beside them: the flavour and "
                            "scale checks need it and were skipped for those tensors")
    return report


def _counterpart(fmt: Format) -> Format | None:
    return FORMATS[fmt.counterpart] if fmt.counterpart else None


def _hex(codes: np.ndarray) -> str:
    return ", ".join(f"0x{int(c):02X}" for c in np.unique(codes)[:6])


def special_codes(entry: Entry) -> list[Diagnosis]:
    fmt, codes = entry.fmt, entry.codes
    values = oracle.decode(codes, fmt)
    other = _counterpart(fmt)
    if fmt.fnuz and other is not None and (codes == 0x80).any():
        count = int((codes == 0x80).sum())
        return [Diagnosis(entry.name, "fnuz_0x80",
                        f"{count} of {codes.size} codes are 0x80 in {fmt.id} data (tagged {entry.tag}): 0x80 is NaN in "
                        f"{fmt.id} and negative zero in {other.id}. Either {other.id} bytes were converted without "
                        f"rewriting 0x80, or values were cast past {fmt.id}'s maximum {oracle.limits(fmt).max:g}",
                        f"when converting from {other.id}, set 0x80 codes to 0x00 and double the scale; when "
                        f"quantizing, compute the scale with {oracle.limits(fmt).max:g} and clamp to it")]
    bad = ~np.isfinite(values)
    if not bad.any():
        return []
    meaning = ""
    if other is not None:
        there = oracle.decode(np.unique(codes[bad])[:6], other)
        meaning = f"; in {other.id} these codes are {', '.join(f'{v:g}' for v in there)}"
    return [Diagnosis(entry.name, "special_codes",
                    f"{int(bad.sum())} of {codes.size} codes ({_hex(codes[bad])}) are NaN or inf in {fmt.id} "
                    f"(tagged {entry.tag}){meaning}",
                    "quantize again, clamping to the format's maximum before the cast; if the codes are another "
                    "format's, tag them with that format")]


def _rebuilt_amax(codes: np.ndarray, scale: float, fmt: Format) -> float | None:
    """The largest finite |value| of ``codes`` decoded as ``fmt``, times the scale."""
    values = oracle.decode(codes, fmt)
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) * scale if finite.size else None


def _matches(rebuilt: float | None, amax: float, fmt: Format) -> bool:
    """Within half a step of ``fmt`` (the rounding of the amax element), relative."""
    return rebuilt is not None and abs(rebuilt - amax) <= amax * 2.0 ** -(oracle.limits(fmt).mantissa_bits + 1)


def per_tensor_scale(entry: Entry) -> list[Diagnosis]:
    fmt, other = entry.fmt, _counterpart(entry.fmt)
    amax, scale = float(entry.amax or 0.0), float(entry.scale)
    if amax <= 0 or scale <= 0 or not np.isfinite(scale):
        return []
    rebuilt = _rebuilt_amax(entry.codes, scale, fmt)
    if _matches(rebuilt, amax, fmt):
        return []
    found = _counterpart_explains(entry, other, amax, scale, rebuilt) if other is not None else None
    if found is not None:
        return [found]
    shown = "nothing finite" if rebuilt is None else f"{rebuilt:.6g}"
    return [Diagnosis(entry.name, "scale_mismatch",
                    f"decoded as {fmt.id} and scaled, its largest value is {shown}, but the amax stored beside it is "
                    f"{amax:.6g}: the scale does not belong to this data",
                    "export the codes, the scale and the amax together from one quantization")]


def _counterpart_explains(entry: Entry, other: Format, amax: float, scale: float,
                          rebuilt: float | None) -> Diagnosis | None:
    """The data written in ``other``, the tagged format's counterpart, or its scale computed with ``other``'s
    maximum; None where neither explains the stored amax."""
    fmt = entry.fmt
    clean = bool(np.isfinite(oracle.decode(entry.codes, other)).all())
    if clean and _matches(_rebuilt_amax(entry.codes, scale, other), amax, other):
        return _flavour(entry, other, amax, rebuilt)
    implied, other_max, own_max = amax / scale, oracle.limits(other).max, oracle.limits(fmt).max
    if fmt.fnuz and other_max != own_max and abs(implied - other_max) <= other_max * 1e-5:
        return Diagnosis(entry.name, "fnuz_scale_448",
                         f"the scale is amax/{implied:.6g}: {other.id}'s maximum {other_max:g} was used where "
                         f"{fmt.id}'s maximum is {own_max:g}, so values come out {other_max / own_max:.4g}x too "
                         f"large ({other_max:g}/{own_max:g}) and overflow {fmt.id} past {own_max:g}",
                         f"compute the scale as amax/{own_max:g} (torch.finfo(torch.{fmt.torch_name}).max)")
    return None


def _flavour(entry: Entry, written: Format, amax: float, rebuilt: float | None) -> Diagnosis:
    tagged = entry.fmt
    factor = oracle.value_ratio(oracle.decode(entry.codes, written), oracle.decode(entry.codes, tagged)) or float("nan")
    as_tagged = "nothing finite" if rebuilt is None else f"{rebuilt:.6g}"
    extra = f", and 0x80 (negative zero in {written.id}) reads as NaN" if tagged.fnuz else ""
    if tagged.fnuz:
        fix = (f"tag it {written.tag}; or convert it to {tagged.id}: set 0x80 codes to 0x00, keep the other bytes "
               "and double the scale")
    else:
        fix = f"tag it {written.tag}; or quantize it again to {tagged.id} with the scale amax/{oracle.limits(tagged).max:g}"
    return Diagnosis(entry.name, "flavour",
                   f"tagged {entry.tag} ({tagged.id}) but written as {written.id}: decoded as {written.id} and scaled "
                   f"its largest value is the stored amax {amax:.6g}, decoded as {tagged.id} it is {as_tagged}. Read "
                   f"as tagged, every value is {factor:g}x its true value (factor {max(factor, 1 / factor):g}){extra}",
                   fix)


def mx_scales(entry: Entry) -> list[Diagnosis]:
    fmt, lim, block = entry.fmt, oracle.limits(entry.fmt), int(entry.block or 0)
    scale_codes = np.asarray(entry.scale, dtype=np.uint8)
    if (scale_codes == 0xFF).any():
        return [Diagnosis(entry.name, "mx_scale", f"{int((scale_codes == 0xFF).sum())} e8m0 block scales are 0xFF, "
                        "e8m0's NaN: every element of those blocks dequantizes to NaN",
                        "compute the shared exponent from a finite amax (OCP MX v1.0 section 6.3)")]
    if entry.scale_rule != checkpoint.SCALE_RULES["mx"]:
        return []  # the expected range of a block's largest element depends on the rule
    values = np.abs(oracle.decode(entry.codes, fmt))
    rows = values.reshape(-1, values.shape[-1])
    padded = np.zeros((rows.shape[0], scale_codes.reshape(rows.shape[0], -1).shape[1] * block), dtype=np.float32)
    padded[:, : rows.shape[1]] = rows
    largest = padded.reshape(rows.shape[0], -1, block).max(axis=-1).reshape(-1)
    # Blocks that are all zero, or whose exponent sits at e8m0's floor of 2**-127, say nothing.
    judged = (largest > 0) & (scale_codes.reshape(-1) > 0)
    low = judged & (largest < 2.0 ** lim.emax)
    if low.any():
        off = sorted({lim.emax - int(np.floor(np.log2(v))) for v in largest[low]})
        return [Diagnosis(entry.name, "mx_scale",
                        f"{int(low.sum())} of {int(judged.sum())} MX blocks have their largest {fmt.id} element below "
                        f"2^{lim.emax} = {2.0 ** lim.emax:g}, where the OCP floor rule puts it in "
                        f"[{2.0 ** lim.emax:g}, {lim.max:g}]: their e8m0 scale is {' or '.join(map(str, off))} exponent(s) "
                        f"too large, and each such block loses as many bits",
                        f"shared exponent = floor(log2(block amax)) - {lim.emax} (OCP MX v1.0 section 6.3)")]
    if judged.sum() >= SATURATED_BLOCKS_MIN and (largest[judged] == lim.max).all():
        return [Diagnosis(entry.name, "mx_scale",
                        f"all {int(judged.sum())} MX blocks saturate at {fmt.id}'s maximum {lim.max:g}: the e8m0 scales "
                        "are too small (a correct scale saturates a block only now and then)",
                        f"shared exponent = floor(log2(block amax)) - {lim.emax} (OCP MX v1.0 section 6.3)")]
    return []
