"""What a check saw, before anyone names a component: the check, where and how much, and the facts it measured.
Triage names it (triage/naming.py); the report prints it. Neutral: every layer may use it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckFinding:
    check: str  # the check that saw it ("merge", "links", "decode", ...), whose rules name it
    message: str  # what failed, where, by how much: one line, or a first line and indented detail lines
    facts: Mapping[str, Any] = field(default_factory=dict)  # what was measured about it ("factor": 2.0)
    scope: str = ""  # how the report introduces the check, if at all: "lora check" -> "lora check 'merge': ..."

    @classmethod
    def of(cls, item: Mapping[str, Any], scope: str = "lora check") -> CheckFinding:
        """From a record's JSON dict ({"check", "message", "facts"}); a component it may hold is not read."""
        return cls(item["check"], item["message"], dict(item.get("facts") or {}), scope)


Problem = str | CheckFinding  # what fails a run besides its comparison: a line that names nothing, or a finding


def text_of(problem: Problem) -> str:
    """What a problem says, without a component: for a record's JSON, or a line quoted inside another."""
    return problem if isinstance(problem, str) else problem.message
