"""Failure messages: what differs, where, by how much, which component, and what changed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..components import tag
from ..evidence import model_layout
from ..stack.fingerprint import describe_change
from .compare import Comparison, Finding

MAX_FINDINGS = 12


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
    return [f"  {describe_change(*change)}" for change in changes]


def format_margins(comparison: Comparison) -> str:
    """Worst deviation per metric as a multiple of its tolerant-lane limit: how close the run came."""
    source = "K x envelope + floor" if comparison.limits_from == "envelope" else "fixed limits"
    cells = ", ".join(f"{metric} {value:.2g}x" for metric, value in comparison.margins.items())
    return f"worst/limit ({source}): {cells}"


def format_drift(comparison: Comparison) -> str | None:
    """For a comparison that passed: where bitwise drift starts in step 0's op trace, or that none did, as
    information (None when a record has no trace)."""
    moved = comparison.first_moved
    if moved is None and comparison.equal_trace is not None and comparison.lane == "tolerant":  # exact: bitwise anyway
        ranks, ops = comparison.equal_trace
        return (f"no bitwise drift (information): all {ops} ops of step 0 equal the reference's on {ranks} "
                f"rank{'s' if ranks != 1 else ''}")
    notes = ("op sequence changed (information, the ops around each change are paired): "
             + ", ".join(comparison.sequence_notes)) if comparison.sequence_notes else None
    if moved is None:
        return notes
    return "; ".join(filter(None, [f"bitwise drift (information): {moved.describe()}", notes]))


def op_lines(comparison: Comparison) -> list[str]:
    """Which op of step 0 gave another answer: what a bug report names. In the exact lane the first op that
    moved; in the tolerant lane the op that introduced a difference, and where legitimate drift began."""
    moved, culprit = comparison.first_moved, comparison.culprit
    # what changed in step 0's op sequence, a note a line: the analysis went on past each change
    sequence = ["op sequence changed since the reference (the ops around each change are paired, and the analysis "
                "goes on past it):", *(f"    {note}" for note in comparison.sequence_notes)] \
        if comparison.sequence_notes else []
    if moved is None:
        return ["", *sequence] if sequence else []
    shape = [f"    {comparison.shape_note}"] if comparison.shape_note else []
    drift = replace(moved, label="drift begins at", stack=[]).describe()
    if culprit is None:
        return ["", f"introduced at: no op of step 0 moved beyond drift ({comparison.introduced_rule}): the "
                "difference starts later, or is per op too small to tell from drift", drift, *sequence]
    # in the exact lane the culprit is the op that moved: no drift is allowed there
    same = (culprit.rank, culprit.entry_index) == (moved.rank, moved.entry_index)
    return ["", *culprit.lines(), *shape, *([] if same else [drift]), *sequence]


def format_finding(finding: Finding) -> list[str]:
    lines = [f"{tag(finding.component)} {finding.message}"]
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
    record_elsewhere_hint: str = "",
) -> str:
    head = [
        f"scenario {scenario!r} on {platform_key} differs from its reference",
        f"  lane: {comparison.lane} ({comparison.lane_reason})",
        f"  reference: {reference_path}",
        *(f"  note: {note}" for note in comparison.notes),
        "",
    ]
    body: list[str] = []
    for finding in comparison.findings[:MAX_FINDINGS]:
        body += format_finding(finding)
    hidden = len(comparison.findings) - MAX_FINDINGS
    if hidden > 0:
        body.append(f"... and {hidden} more findings")
    body += op_lines(comparison)
    tail = [
        "",
        "what changed in the stack since the reference was recorded:",
        *format_stack_changes(comparison.stack_changes),
        "",
        _record_advice(comparison, record_hint, record_elsewhere_hint),
    ]
    return "\n".join(head + body + tail)


def _record_advice(comparison: Comparison, record_hint: str, record_elsewhere_hint: str) -> str:
    """What to record: over the reference if the new numbers are right; where the model's code changed, a reference
    of this stack's own in another folder, as the model finding says (the old stack keeps its reference)."""
    layout = comparison.finding(model_layout.METRIC)
    if layout is not None:
        if model_layout.is_tie(layout.metric, layout.facts):
            return (f"record nothing: {model_layout.BUILT_OTHERWISE} (the first finding); report it to "
                    f"{layout.facts['built_by']}, with this reference and this run's record as the evidence")
        if record_elsewhere_hint:
            return ("this stack needs a reference of its own: record it into another folder, keeping this one: "
                    f"{record_elsewhere_hint}")
    library = next((f.component for f in comparison.findings if f.component.startswith("library:")), None)
    if library is not None:  # not a kernel to re-record over: code that computes another function
        package = library.split(":", 1)[1].strip()
        return (f"the model's code changed with {package}: check its release notes (or the patch on this machine); "
                "if the new numbers are what it means to compute, record a reference of this stack's own into "
                f"another folder, keeping this one: {record_elsewhere_hint or record_hint}")
    return f"if the new numbers are right, record them as the reference: {record_hint}"
