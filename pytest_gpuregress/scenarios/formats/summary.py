"""The formats scenario's lines in the terminal summary: what this stack does, not only pass or fail. torch-free."""

from __future__ import annotations

import math

from ...reference.record import RunRecord
from . import grid, judge
from .catalog import FORMATS, SCHEMES

SCALED_MM_OFF_CPU = ("torch._scaled_mm (fp8 matrix multiply): not applicable on the cpu; it runs on GPUs with fp8 matrix "
                     "multiply (sm_89+, gfx942+)")


def lines(record: RunRecord, on_cpu: bool) -> list[str]:
    where = record.results.get("device", {})
    out = [f"checked on {where.get('name')} (torch {where.get('torch')}) by {record.world_size} ranks in "
           f"{record.timings.get('launch_wall_s', 0.0):.1f}s; against ml_dtypes"]
    out += behaviour_lines(record)
    if not where.get("native_fp4_cast", True):
        out.append(f"  e2m1fn: torch {where.get('torch')} has no float4_e2m1fn_x2 cast; fp4 goes through the "
                   "scenario's torch-op codec, checked against the oracle")
    out += quantized_lines(record)
    out += scaled_mm_lines(record, on_cpu)
    out += io_lines(record)
    warned = record.results.get("warned", [])
    if warned:
        out.append("format behaviours that changed since the reference (--gpuregress-format-changes=warn, not failed):")
        out += [f"  {change}" for change in warned]
    return out


def behaviour_lines(record: RunRecord) -> list[str]:
    """Per format, what the device does outside its range: 'e4m3fn    overflow saturates to 448; ...'."""
    out = []
    for fmt in FORMATS.values():
        found = judge.behaviours(fmt, record)
        if found:
            out.append(f"  {fmt.id:<9} " + "; ".join(f"{name} {grid.describe(e)}" for name, e in found.items()))
    out += [f"  {fmt_id}: not checked: {reason}" for fmt_id, reason in record.results.get("unavailable", {}).items()]
    return out


def quantized_lines(record: RunRecord) -> list[str]:
    quantized = record.results.get("quantized", {})
    out = []
    for scheme, result in ((s, quantized[s]) for s in SCHEMES if s in quantized):
        if "error" in result:
            out.append(f"  {scheme}: raised {result['error']}")
            continue
        deviation = result["deviation_from_fp32"]
        logits = f"within {100 * deviation:.2g}% of fp32" if math.isfinite(deviation) else "not finite"
        out.append(f"  {scheme}: {result['file_bytes']} bytes, logits {logits}")
    return out


def scaled_mm_lines(record: RunRecord, on_cpu: bool) -> list[str]:
    result = record.results.get("scaled_mm")
    if result is None:
        return [f"  {SCALED_MM_OFF_CPU}"] if on_cpu else []
    if not result.get("applicable"):
        return [f"  torch._scaled_mm: not applicable: {result['reason']}"]
    if "error" in result:
        return [f"  torch._scaled_mm {result['format']} on {result['arch']}: raised {result['error']}"]
    if "call_rejected" in result:
        return [f"  {judge.call_rejected(result)}"]
    if "refused" in result:
        return [f"  {judge.refusal(result)}"]
    return [f"  torch._scaled_mm {result['format']} on {result['arch']}: worst error {result['worst_ratio']:.3g} "
            "of its derived bound"]


def io_lines(record: RunRecord) -> list[str]:
    """Per I/O path of the stack: what it read and wrote, and the known issues it showed."""
    out = []
    for path, result in record.results.get("io", {}).items():
        if result["skipped"]:
            out.append(f"  io {path}: not exercised: {result['skipped']}")
            continue
        verdict = f"{len(result['problems'])} problems" if result["problems"] else "byte for byte"
        out.append(f"  io {path} ({result['library']}): {result['checked']} tensors, {verdict}")
        out += [f"    {text}" for text in result["known_issues"]]
    return out
