"""The closing summary: one row per reference judged or recorded, and the command that reproduces each failure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["passed", "failed", "recorded", "error", "not supported"]


@dataclass
class Outcome:
    """One scenario run, for the terminal summary."""

    scenario: str
    platform_key: str
    verdict: Verdict
    lane: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    worst: float | None = None  # the largest deviation as a multiple of its tolerant-lane limit
    seconds: float | None = None
    reproduce: str = ""  # the command that reproduces the verdict: record on a missing reference, compare on a failure


def add_outcome(outcomes: list[Outcome], outcome: Outcome) -> None:
    """Append ``outcome`` once: the cases of one launch (or of one reference) make one summary line."""
    if outcome not in outcomes:
        outcomes.append(outcome)


def outcome_lines(outcomes: list[Outcome]) -> list[str]:
    """Per outcome: one short line (the case, its verdict and lane, what the run did), then its detail's other parts
    (the reference, the margins, perf, the lane's reason) and its notes on indented lines, one each, so no line runs
    on for several terminal lines. A detail reads "8 steps, loss a -> b, reference PATH; worst/limit ...; perf ..."."""
    lines = []
    for outcome in outcomes:
        lane = f" [{outcome.lane} lane]" if outcome.lane else ""
        first, *rest = outcome.detail.split("; ")
        did, _, reference = first.partition(", reference ")
        lines.append(f"{outcome.scenario} {outcome.platform_key}: {outcome.verdict.upper()}{lane} {did}".rstrip())
        lines += [f"    {part}" for part in [*([f"reference {reference}"] if reference else []), *rest]]
        lines += [f"    note: {note}" for note in outcome.notes]
    return lines


def summary_table(outcomes: list[Outcome]) -> list[str]:
    """One row per scenario, then the command that reproduces each verdict that is not a pass."""
    if not outcomes:
        return []
    rows = [("scenario", "platform", "lane", "verdict", "worst/tol", "seconds"), *map(_row, outcomes)]
    return ["", *_columns(rows), *(f"reproduce {o.scenario}: {o.reproduce}" for o in outcomes if o.reproduce)]


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` in columns as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _row(o: Outcome) -> tuple[str, ...]:
    return (o.scenario, o.platform_key, o.lane or "-", o.verdict.upper(), "-" if o.worst is None else f"{o.worst:.2g}x",
            "-" if o.seconds is None else f"{o.seconds:.1f}")
