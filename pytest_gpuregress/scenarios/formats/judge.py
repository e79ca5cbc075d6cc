"""Verdicts and reference comparisons of the formats scenario, from a launch's record. torch-free.

Closed-form verdicts need no reference. Behaviours and checksums are discrete or exact, so they compare exactly
in every lane; logits compare exactly in the exact lane and within LOGITS_TOLERANCE in the tolerant one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...comparison.compare import Finding
from ...errors import CallRejected
from ...findings import CheckFinding, Problem
from ...reference.record import RunRecord
from . import grid, oracle
from .catalog import FORMATS, Format

EXAMPLES = 4
# Tolerant lane, logits on the fixed batch, |diff| / max|reference|. Measured on the CPU: every linear
# layer's output x (1 + 1e-7), the size of legitimate kernel drift (docs/faults.md section 4), moves
# them by at most 4.7e-7; the mildest number-format fault (an MX scale one exponent too large) by
# 4.5e-2, the others by 0.37 or more, or to NaN. 1e-4 sits 200x above the one and 400x below the
# other; tests/scenarios/formats/test_formats_scenario.py checks both sides.
LOGITS_TOLERANCE = 1e-4


class FormatBehaviourChanged(UserWarning):
    """A format behaviour differs from the reference, and --gpuregress-format-changes=warn said not to fail."""


class KnownStackIssue(UserWarning):
    """The stack's checkpoint I/O failed in a way known_issues.py names: reported, not failed."""


def _where(record: RunRecord) -> str:
    return str(record.results.get("device", {}).get("name", "the device"))


def _num(v: float) -> str:
    return grid.number(float(v))


def raised(case_id: str, record: RunRecord) -> list[Problem]:
    """A cast or decode that raised on the device is a finding of its case, as a wrong value is."""
    error = record.results.get("errors", {}).get(case_id)
    return [CheckFinding("format", f"{case_id.replace('-', ' ', 1)}: raised on {_where(record)}: {error}")] if error \
        else []


def _unmeasured(kind: str, fmt: Format, record: RunRecord, *arrays: str) -> list[Problem] | None:
    """The findings of a decode or encode case with nothing to judge: it raised, or its arrays are missing (no
    finding where the format is unavailable here); None where its measurement is in the record."""
    errors = raised(f"{kind}-{fmt.id}", record)
    if errors:
        return errors
    if any(record.arrays.get(key) is None for key in arrays):
        return [] if fmt.id in record.results.get("unavailable", {}) else \
            [CheckFinding("format", f"{kind} {fmt.id}: not in the record")]
    return None


def decode_problems(fmt: Format, record: RunRecord) -> list[Problem]:
    unmeasured = _unmeasured("decode", fmt, record, f"decode/{fmt.id}/codes", f"decode/{fmt.id}")
    if unmeasured is not None:
        return unmeasured
    codes, values = record.arrays[f"decode/{fmt.id}/codes"], record.arrays[f"decode/{fmt.id}"]
    expected = oracle.decode(codes, fmt)
    wrong = ~oracle.same_values(expected, values)
    if not wrong.any():
        return []
    text = (f"decode {fmt.id}: {int(wrong.sum())} of {codes.size} codes decode on {_where(record)} unlike "
            f"the oracle (ml_dtypes.{fmt.oracle_name})")
    read_as = oracle.identify(codes, values, fmt)
    if read_as is not None:
        text += f"; the device's values are exactly {read_as.id}'s: {fmt.id} bytes are read as {read_as.id}"
        ratio = oracle.value_ratio(expected, values)
        if ratio:
            text += f", every value {ratio:g}x (factor {max(ratio, 1 / ratio):g})"
    shown = [f"0x{int(c):02X}: oracle {_num(e)}, device {_num(v)}"
             for c, e, v in zip(codes[wrong][:EXAMPLES], expected[wrong], values[wrong])]
    return [CheckFinding("format", text + "; " + "; ".join(shown))]


def encode_problems(fmt: Format, record: RunRecord) -> list[Problem]:
    unmeasured = _unmeasured("encode", fmt, record, f"encode/{fmt.id}")
    if unmeasured is not None:
        return unmeasured
    compared, wrong = grid.in_range_mismatches(record.arrays["encode/grid"], record.arrays[f"encode/{fmt.id}"], fmt)
    if not wrong:
        return []
    shown = [f"{_num(w['value'])} -> device 0x{w['device_code']:02X} ({_num(w['device'])}), oracle "
             f"0x{w['oracle_code']:02X} ({_num(w['oracle'])})" for w in wrong[:EXAMPLES]]
    return [CheckFinding("format", f"encode {fmt.id}: {len(wrong)} of {compared} in-range grid values cast on "
                         f"{_where(record)} unlike the oracle's round-to-nearest-even: " + "; ".join(shown))]


def behaviours(fmt: Format, record: RunRecord) -> dict[str, list[dict[str, Any]]] | None:
    codes = record.arrays.get(f"encode/{fmt.id}")
    return None if codes is None else grid.behaviours(record.arrays["encode/grid"], codes, fmt)


def behaviour_changes(fmt: Format, reference: RunRecord, record: RunRecord) -> list[str]:
    before, now = behaviours(fmt, reference), behaviours(fmt, record)
    if now is None:
        return []  # the format is unavailable here; its decode and encode cases say so
    if before is None:
        return [f"the reference holds no {fmt.id} encode results: record it with every formats case ('gpuregress::formats*')"]
    return grid.behaviour_changes(before, now, fmt)


def quantized_problems(scheme: str, record: RunRecord) -> list[Problem]:
    result = record.results.get("quantized", {}).get(scheme)
    if result is None:
        return [CheckFinding("quantized", f"{scheme}: not in the record")]
    if "error" in result:
        return [CheckFinding("quantized", f"{scheme}: the round trip raised {result['error']}")]
    return [CheckFinding("quantized", f"{scheme}: {p}") for p in result["problems"]]


def inspect_problems(record: RunRecord) -> list[Problem]:
    return [CheckFinding("inspect", f"{scheme}.safetensors: {text}")
            for scheme, report in record.results.get("inspect", {}).items() for text in report["findings"]]


def io_problems(path: str, record: RunRecord) -> list[Problem]:
    """The stack's I/O path ``path`` against the codec: every problem, or that the launch did not try it."""
    result = record.results.get("io", {}).get(path)
    if result is None:
        return [CheckFinding("checkpoint-io", f"{path}: not in the record (the quantized round trip raised for every "
                                              "scheme?)")]
    where = f"{path} ({result['library']})"
    if not result["checked"] and not result["problems"] and not result["skipped"]:
        why = " (every scheme ended in a known issue)" if result["known_issues"] else ""
        return [CheckFinding("checkpoint-io", f"{where}: compared no tensor{why}: the path was not exercised")]
    return [CheckFinding("checkpoint-io", f"{where}: {p}") for p in result["problems"]]


def scaled_mm_problems(record: RunRecord) -> list[Problem]:
    result = record.results.get("scaled_mm") or {}
    if not result.get("applicable"):
        return []
    if "error" in result:
        return [CheckFinding("scaled-mm", f"torch._scaled_mm {result['format']} on {result['arch']} raised "
                                          f"{result['error']}")]
    if "call_rejected" in result:  # not a finding against the stack: the plugin's own call is wrong
        raise CallRejected(call_rejected(result))
    if "refused" in result:
        return [CheckFinding("scaled-mm", refusal(result))]
    if result["non_finite"] or not result["worst_ratio"] <= 1.0:
        return [CheckFinding("scaled-mm", f"torch._scaled_mm {result['format']} {result['shape']} on {result['arch']}: "
                             f"at {tuple(result['worst_at'])} expected {result['expected']!r} (oracle, float64), got "
                             f"{result['got']!r}: {result['worst_ratio']:.3g}x the derived error bound "
                             f"{result['bound']:.3g}; {result['non_finite']} non-finite outputs")]
    return []


def refusal(result: dict[str, Any]) -> str:
    """A _scaled_mm that refused its format, said as a fact about the stack."""
    return (f"this stack's torch._scaled_mm does not accept {result['format']} on {result['arch']}: {result['refused']}; "
            f"a device that multiplies {result['format']} natively should, so its kernel library (cuBLASLt, hipBLASLt, "
            "oneDNN) changed or lost the format")


def call_rejected(result: dict[str, Any]) -> str:
    """torch's argument checks turning down the plugin's own _scaled_mm call, said as the plugin's bug."""
    return (f"the plugin called torch._scaled_mm wrongly for {result['format']} {result['shape']} on {result['arch']}: "
            f"torch's own argument checks rejected the call ({result['call_rejected']}); this is a bug of "
            "pytest-gpuregress (scenarios/formats/scaled_mm.py), not a finding about the stack: please report it")


def stale_reference(part: str, key: str, reference: RunRecord) -> list[Problem]:
    """The closed-form failures a reference carries for a behaviour (key: format id) or quantized case."""
    if part == "behaviour":
        return encode_problems(FORMATS[key], reference) if f"encode/{key}" in reference.arrays else []
    return quantized_problems(key, reference) if key in reference.results.get("quantized", {}) else []


def quantized_findings(scheme: str, reference: RunRecord, record: RunRecord, lane: str) -> list[Finding]:
    before = reference.results.get("quantized", {}).get(scheme)
    now = record.results.get("quantized", {}).get(scheme)
    if now is not None and "error" in now:
        return []  # the verdict reports it
    stale = before is None or "error" in before
    if stale or now is None:
        where = "the reference" if stale else "this run"
        return [Finding("quantized", f"{scheme}: {where} holds no results for this scheme; "
                        "record the reference with every formats case ('gpuregress::formats*')")]
    return _checksums(scheme, before["tensors"], now["tensors"]) + _logits(scheme, reference, record, lane)


def _checksums(scheme: str, before: dict[str, Any], now: dict[str, Any]) -> list[Finding]:
    """The tensors whose codes, scales or dequantized sums differ from the reference's, the first one shown."""
    differ = [name for name, sums in before.items() if now.get(name) != sums]
    if not differ:
        return []
    # Show a tensor whose sums stayed finite if there is one: its ratio says what happened.
    name = next((n for n in differ if np.isfinite((now.get(n) or {}).get("abs_sum", np.nan))), differ[0])
    a, b = before[name], now.get(name) or {}
    ratio = b.get("abs_sum", float("nan")) / a["abs_sum"] if a["abs_sum"] else float("nan")
    return [Finding(
        "checksums",
        f"{scheme}: {len(differ)} of {len(before)} tensors differ from the reference (codes, scales or "
        f"dequantized float64 sums, compared exactly: quantizing is exact arithmetic); first {name}: sum "
        f"{a['sum']!r} -> {b.get('sum')!r}, sum|w| ratio {ratio:.6g}", tensor=name, expected=a["sum"],
        got=b.get("sum"))]


def _logits(scheme: str, reference: RunRecord, record: RunRecord, lane: str) -> list[Finding]:
    key = f"logits/{scheme}"
    ref, got = reference.arrays.get(key), record.arrays.get(key)
    if ref is None or got is None or ref.shape != got.shape:
        return [Finding("logits", f"{scheme}: logits missing or reshaped ({key})")]
    if lane == "exact":
        bad = not oracle.same_values(ref, got).all()
        measure = "bitwise"
    else:
        scale = max(float(np.abs(ref).max()), np.finfo(np.float32).tiny)
        with np.errstate(invalid="ignore"):
            diff = np.abs(oracle.as_float64(got) - oracle.as_float64(ref)) / scale
        worst = float(np.nan_to_num(np.where(oracle.same_values(ref, got), 0.0, diff), nan=np.inf).max())
        bad = worst > LOGITS_TOLERANCE
        measure = f"max |diff|/max|ref| {worst:.3g} > {LOGITS_TOLERANCE:g}"
    if not bad:
        return []
    moved = ~oracle.same_values(ref, got)  # not empty: a NaN where the reference has one moves nothing
    first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(moved)[0]), ref.shape))
    return [Finding("logits",
                    f"{scheme}: logits on the fixed batch differ ({measure}): {int(moved.sum())} of {ref.size} values, "
                    f"first at {first}: expected {float(ref[first])!r}, got {float(got[first])!r}",
                    expected=float(ref[first]), got=float(got[first]))]


def rank_differences(first: RunRecord, other: RunRecord) -> list[str]:
    """Case ids whose measurements differ between two ranks' records."""
    out = _array_differences(first, other)
    for scheme, result in first.results.get("quantized", {}).items():
        peer = other.results.get("quantized", {}).get(scheme) or {}
        if (result.get("tensors"), result.get("logits")) != (peer.get("tensors"), peer.get("logits")):
            out.append(f"quantized-{scheme}")
    if first.results.get("inspect") != other.results.get("inspect"):
        out.append("inspect")
    out += _io_differences(first, other)
    return sorted(set(out))


def _array_differences(first: RunRecord, other: RunRecord) -> list[str]:
    """The decode and encode cases (an encode's behaviour case with it) whose arrays differ between two ranks."""
    out = []
    for key in sorted(k for k in first.arrays if k.startswith(("decode/", "encode/")) and k != "encode/grid"):
        mine, theirs = first.arrays[key], other.arrays.get(key)
        if theirs is None or mine.tobytes() != theirs.tobytes():
            kind, fmt = key.split("/")[:2]
            out += [f"{kind}-{fmt}"] + ([f"behaviour-{fmt}"] if kind == "encode" else [])
    return out


def _io_differences(first: RunRecord, other: RunRecord) -> list[str]:
    """The I/O paths whose problems or known issues differ between two ranks that both checked them."""
    out = []
    for path, result in first.results.get("io", {}).items():
        peer = other.results.get("io", {}).get(path) or {}
        if peer.get("skipped") and not peer.get("checked"):
            continue  # a path only rank 0 checks (transformers' save_pretrained): the peer measured nothing
        if (result["problems"], result["known_issues"]) != (peer.get("problems"), peer.get("known_issues")):
            out.append(f"io-{path}")
    return out
