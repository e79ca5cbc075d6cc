"""What a scenario's own check found, named: the component its finding points at, by rules with stable ids.

A check (LoRA's merge, its adapter round trip, ...) reports what it saw: which check, a message, and the facts it
measured (``facts``: a merged weight off by an exact factor, a base weight the library left trainable). Which
component that is, is decided here, in one table, as the training verdicts are in ``decision.py``: a check that
named its own component would one day name the wrong one. torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..components import tag
from ..findings import CheckFinding, Problem

PEFT = "library: peft"  # the LoRA layers, their freezing of the base, their merge and their dropout are peft's code


@dataclass(frozen=True)
class CheckRule:
    id: str  # stable: a verdict names its rule by it
    check: str  # the check whose findings it reads
    evidence: str  # what must be there, in the docs' words
    component: str
    applies: Callable[[Mapping[str, Any]], bool] = lambda facts: True  # on the finding's facts


def _factor(facts: Mapping[str, Any]) -> bool:
    return facts.get("factor") is not None


def _library_left_trainable(facts: Mapping[str, Any]) -> bool:
    return bool(facts.get("left_trainable"))


# Read top to bottom per check: the first rule of a finding's check whose facts are there names it.
CHECK_RULES: tuple[CheckRule, ...] = (
    CheckRule("lora-merge-arithmetic", "merge", "the merged weight is W plus an exact multiple k != 1 of "
              "scale*lora_B@lora_A, within rounding: arithmetic (a scaling applied twice or left out), which no "
              "kernel's rounding makes", PEFT, _factor),
    CheckRule("lora-merge-rounding", "merge", "the merged weight is off W + scale*lora_B@lora_A beyond the rounding "
              "bound of that sum, and is no multiple of the adapter's product", "kernel"),
    CheckRule("lora-base-left-trainable", "frozen-base", "a frozen base weight received a gradient or is missing: "
              "the library left it trainable or dropped it", PEFT, _library_left_trainable),
    CheckRule("lora-base-moved", "frozen-base", "a base weight changed without ever receiving a gradient: an "
              "optimizer stepped it anyway, or a collective or a load wrote into it", "optimizer or collective"),
    CheckRule("lora-adapter-untrained", "adapter-nonzero", "an adapter is missing, empty or all zeros after training",
              "optimizer"),
    CheckRule("lora-sharded-save", "sharded-save", "the saved adapter lacks a rank's slice (another shape than the "
              "full tensor)", "checkpoint"),
    CheckRule("lora-adapter-roundtrip", "adapter-roundtrip", "save_pretrained then from_pretrained gives other "
              "tensors or logits", "checkpoint"),
    CheckRule("lora-dropout", "dropout", "peft's lora_dropout is on in eval, off in train, or drops another share",
              PEFT),
)
CHECKS: tuple[str, ...] = tuple(dict.fromkeys(rule.check for rule in CHECK_RULES))


def rule_for(finding: CheckFinding) -> CheckRule:
    """The rule that names ``finding``: the first of its check's rules whose facts are there."""
    for rule in CHECK_RULES:
        if rule.check == finding.check and rule.applies(finding.facts):
            return rule
    raise ValueError(f"no rule names a finding of check {finding.check!r}; known: {', '.join(CHECKS)}")


def described(problem: Problem) -> str:
    """A problem as the report prints it: a check's finding with the component its rule names, and the rule's id;
    a complete line as it is. A check no rule knows (a kept record of another version) is printed, naming nothing."""
    if isinstance(problem, str):
        return problem
    if problem.check not in CHECKS:
        return f"{tag('unknown')} {problem.scope} '{problem.check}': {problem.message} (no rule names this check)"
    rule = rule_for(problem)
    return f"{tag(rule.component)} {problem.scope} '{problem.check}': {problem.message} (rule {rule.id})"


def markdown_table() -> list[str]:
    """docs/lora.md's table of the rules that name a check's finding."""
    lines = ["| rule | check | when the finding shows | it names |", "| --- | --- | --- | --- |"]
    return lines + [f"| `{r.id}` | {r.check} | {r.evidence} | `[{r.component}]` |" for r in CHECK_RULES]
