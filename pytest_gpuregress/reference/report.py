"""Failure messages: what differs, where, by how much, which component, and what changed."""

from __future__ import annotations

from typing import Any

from .compare import Comparison, Finding

MAX_FINDINGS = 12


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.9g}"
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def format_table(rows: list[tuple[str, float, float, float]], diff_label: str = "diff") -> list[str]:
    if not rows:
        return []
    width = max(10, *(len(r[0]) for r in rows))
    lines = [f"      {'where':<{width}}  {'expected':>16}  {'got':>16}  {diff_label:>10}"]
    lines += [f"      {where:<{width}}  {exp:>16.9g}  {got:>16.9g}  {diff:>10.3g}" for where, exp, got, diff in rows]
    return lines


def format_stack_changes(changes: list[tuple[str, Any, Any]]) -> list[str]:
    if not changes:
        return ["  nothing in the stack fingerprint changed: suspect nondeterminism, an injected fault, "
                "or hardware"]
    return [f"  {name}: {_fmt(old)} -> {_fmt(new)}" for name, old, new in changes]


def format_finding(finding: Finding) -> list[str]:
    lines = [f"[{finding.component}] {finding.message}"]
    if finding.worst:
        label = "rel diff" if finding.metric != "step0_grad" else "|d|/max|r|"
        lines += ["    worst entries:", *format_table(finding.worst, label)]
    return lines


def format_comparison(
    comparison: Comparison,
    *,
    scenario: str,
    platform_key: str,
    reference_path: str,
    record_hint: str,
) -> str:
    head = [
        f"scenario {scenario!r} on {platform_key} differs from its reference",
        f"  lane: {comparison.lane} ({comparison.lane_reason})",
        f"  reference: {reference_path}",
        "",
    ]
    body: list[str] = []
    for finding in comparison.findings[:MAX_FINDINGS]:
        body += format_finding(finding)
    hidden = len(comparison.findings) - MAX_FINDINGS
    if hidden > 0:
        body.append(f"... and {hidden} more findings")
    tail = [
        "",
        "what changed in the stack since the reference was recorded:",
        *format_stack_changes(comparison.stack_changes),
        "",
        f"if the new numbers are right, record them as the reference: {record_hint}",
    ]
    return "\n".join(head + body + tail)
