"""What each finding names: the component a check's or a comparison's finding points at, by rules with ids.

Checks report only facts; naming is decided here, in two tables read top to bottom, because a check that named
its own component would one day name the wrong one. ``convict`` lets the experiments convict one for all. torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..comparison.compare import ROUND_TRIP, clip_moved_first, gradients_moved_first
from ..components import tag
from ..evidence.model_layout import METRIC as LAYOUT
from ..evidence.oracle_distance import PRECISION_METRIC as PRECISION
from ..evidence.oracle_step0 import METRIC as ORACLE_MOVED
from ..findings import CheckFinding, Problem

if TYPE_CHECKING:
    from ..comparison.compare import Comparison, Finding
    from ..evidence.first_moved import FirstMoved

PEFT = "library: peft"  # the LoRA layers, their freezing of the base, their merge and their dropout are peft's code


@dataclass(frozen=True)
class CheckRule:
    id: str  # stable: a line names its rule by it
    check: str  # the check whose findings it reads
    evidence: str  # what must be there, in the docs' words
    component: str
    applies: Callable[[Mapping[str, Any]], bool] = lambda facts: True  # on the finding's facts


def _fact(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda facts: bool(facts.get(name) is not None and facts.get(name) is not False)


LORA_RULES: tuple[CheckRule, ...] = (
    CheckRule("lora-merge-arithmetic", "merge", "the merged weight is W plus an exact multiple k != 1 of "
              "scale*lora_B@lora_A, within rounding: arithmetic (a scaling applied twice or left out), which no "
              "kernel's rounding makes", PEFT, _fact("factor")),
    CheckRule("lora-merge-rounding", "merge", "the merged weight is off W + scale*lora_B@lora_A beyond the rounding "
              "bound of that sum, and is no multiple of the adapter's product", "kernel"),
    CheckRule("lora-base-left-trainable", "frozen-base", "a frozen base weight received a gradient or is missing: "
              "the library left it trainable or dropped it", PEFT, _fact("left_trainable")),
    CheckRule("lora-base-moved", "frozen-base", "a base weight changed without ever receiving a gradient: an "
              "optimizer stepped it anyway, or a collective or a load wrote into it", "optimizer or collective"),
    CheckRule("lora-adapter-missing", "adapter-nonzero", "a module the config targets has no adapter at all: the "
              "library built none", PEFT, _fact("missing")),
    CheckRule("lora-adapter-untrained", "adapter-nonzero", "an adapter is missing, empty or all zeros after training",
              "optimizer"),
    CheckRule("lora-sharded-save", "sharded-save", "the saved adapter lacks a rank's slice (another shape than the "
              "full tensor)", "checkpoint"),
    CheckRule("lora-roundtrip-same-tensors", "adapter-roundtrip", "the adapter came back bit for bit (saved and "
              "reloaded), yet the reloaded model's logits differ from the trained one's: the two models run other code "
              "(a wrapper, an autocast or a hook a library put on the trained model), not the checkpoint", "library",
              _fact("tensors_kept")),
    CheckRule("lora-adapter-roundtrip", "adapter-roundtrip", "save_pretrained then from_pretrained gives other "
              "tensors, or other logits from other tensors", "checkpoint"),
    CheckRule("lora-dropout", "dropout", "peft's lora_dropout is on in eval, off in train, or drops another share",
              PEFT),
)
CHECKS: tuple[str, ...] = tuple(dict.fromkeys(rule.check for rule in LORA_RULES))  # the LoRA checks a rule names
# Every other check of a run, a scenario or a session; each names one component whatever its facts.
CHECK_RULES: tuple[CheckRule, ...] = (
    *LORA_RULES,
    CheckRule("lora-checks-missing", "lora-missing", "the LoRA checks' results are missing from the run (the "
              "adapter was not saved or read back)", "checkpoint"),
    CheckRule("sweep-inputs", "collective-inputs", "a sweep case's own inputs came out of the cast that made them "
              "wrong, before any collective ran", "kernel"),
    CheckRule("sweep-wrong", "collective-case", "a sweep case's output differs from its closed-form expectation on "
              "some rank (wrong elements, an error, a hang)", "collective"),
    CheckRule("links", "links", "the sweep's wrong elements sorted by sender and receiver: one link, one sender, one "
              "receiver, or every pair", "collective"),
    CheckRule("collective-invariants", "collective-invariants", "a collective of the training run broke its own "
              "invariant across the ranks (bit-identical outputs, sums kept) at some step", "collective"),
    CheckRule("clip-inconsistent", "clip", "the clip reported another norm than its gradients have, or scaled them "
              "by another coefficient than its norm asks for", "optimizer"),
    CheckRule("host-ops", "host-ops", "ops ran on the CPU while the scenario runs on an accelerator", "kernel"),
    CheckRule("kernels-changed-fail", "kernel-changes", "the ops now run other kernels, and "
              "--gpuregress-kernel-changes=fail", "kernel"),
    CheckRule("perf-fail", "performance", "a step time or memory figure past its limit, and --gpuregress-perf=fail",
              "performance"),
    CheckRule("device-dissents", "consensus", "a device's result differs from the majority of the devices of its "
              "model and stack, or no result holds a majority", "device"),
    CheckRule("format-codec", "format", "a decode or encode differs from the ml_dtypes oracle, raised, or is missing",
              "format"),
    CheckRule("quantized-roundtrip", "quantized", "a quantized round trip's own checks failed or it raised",
              "quantization"),
    CheckRule("checkpoint-io", "checkpoint-io", "the stack's own checkpoint I/O (safetensors, torch.load, DCP, "
              "from_pretrained) gave back other fp8 or fp4 tensors than were written, or was not exercised",
              "checkpoint"),
    CheckRule("fp8-matmul", "scaled-mm", "torch._scaled_mm refused the device's fp8 format, raised, or is off the "
              "float64 oracle beyond its derived error bound", "kernel"),
    CheckRule("checkpoint-inspect", "inspect", "a quantized checkpoint's safetensors file says another format than "
              "its tensors hold", "checkpoint"),
    CheckRule("checkpoint-part", "checkpoint", "a checkpoint round trip (a full or sharded state dict, a resume) gave "
              "back another piece of state than was saved", "checkpoint"),
)


KNOWN_CHECKS: tuple[str, ...] = tuple(dict.fromkeys(rule.check for rule in CHECK_RULES))  # the checks a rule names


def rule_for(finding: CheckFinding) -> CheckRule:
    """The rule that names ``finding``: the first of its check's rules whose facts are there."""
    for rule in CHECK_RULES:
        if rule.check == finding.check and rule.applies(finding.facts):
            return rule
    raise ValueError(f"no rule names a finding of check {finding.check!r}; known: {', '.join(KNOWN_CHECKS)}")


def component_of(problem: Problem) -> str | None:
    """The component a problem's rule names; None for a line that names nothing, or a check no rule knows."""
    if isinstance(problem, str) or problem.check not in KNOWN_CHECKS:
        return None
    return rule_for(problem).component


def described(problem: Problem) -> str:
    """A problem as the report prints it: a check's finding with the component its rule names and the rule's id (at
    the end of its first line); a line that names nothing as it is. A check no rule knows (a kept record of another
    version) is printed, naming nothing."""
    if isinstance(problem, str):
        return problem
    scoped = f"{problem.scope} '{problem.check}': " if problem.scope else ""
    first, newline, rest = problem.message.partition("\n")
    if problem.check not in KNOWN_CHECKS:
        return f"{tag('unknown')} {scoped}{first} (no rule names this check){newline}{rest}"
    rule = rule_for(problem)
    return f"{tag(rule.component)} {scoped}{first} (rule {rule.id}){newline}{rest}"


def markdown_table(rules: tuple[CheckRule, ...] = LORA_RULES) -> list[str]:
    """A docs table of the rules that name a check's finding (docs/lora.md: LoRA's; docs/triage.md: all)."""
    lines = ["| rule | check | when the finding shows | it names |", "| --- | --- | --- | --- |"]
    return lines + [f"| `{r.id}` | {r.check} | {r.evidence} | `[{r.component}]` |" for r in rules]


# --- a comparison's findings -------------------------------------------------------------------------------------

# A step-0 gradient wrong in fewer than this share of its elements points at a collective: a kernel change moves
# nearly every element; a corrupted reduce-scatter a few. For a large tensor kept as block sums, of its blocks.
SPARSE_FRACTION = {"elements": 0.05, "blocks": 0.5}


GRADIENTS = ("step0_grad", "late_grad")  # gradients judged element by element: step 0's, and a resume's step S's


def _layout(finding: Finding, comparison: Comparison) -> str | None:
    if finding.metric != LAYOUT:
        return None
    built_by = finding.facts.get("built_by") or ("peft" if finding.facts.get("adapters_only") else None)
    return f"library: {built_by}" if built_by else "model"


def _follows_layout(finding: Finding, comparison: Comparison) -> str | None:
    layout = comparison.finding(LAYOUT)
    return None if layout is None or finding.metric == "data" else _layout(layout, comparison)


def _follows_data(finding: Finding, comparison: Comparison) -> str | None:
    changed = comparison.finding("data")
    if changed is None or finding.metric == ROUND_TRIP or changed.step is None:
        return None
    return "data" if finding.step is None or finding.step >= changed.step else None


def _clip_moved_first(finding: Finding, comparison: Comparison) -> str | None:
    """The clipped norm moved before everything else: a step's loss and gradients (before clipping) come before its
    clip, so a clip that went wrong at step s moves them from s + 1 on, never at s."""
    return "optimizer" if clip_moved_first(comparison.findings) is not None else None


def sparse(finding: Finding) -> bool:
    return finding.fraction is not None and finding.fraction < SPARSE_FRACTION.get(finding.unit, 0.0)


def _step0(finding: Finding, comparison: Comparison) -> str | None:
    """A step-0 gradient (or a resume's first gradients, judged as step 0's) names the collective where few of its
    elements moved, a kernel where nearly all did; every later finding follows from the first one that moved."""
    moved = finding if finding.metric in GRADIENTS else comparison.finding(*GRADIENTS)
    return None if moved is None else "collective" if sparse(moved) else "kernel"


def _later(finding: Finding, comparison: Comparison) -> str:
    """No step-0 gradient moved: a loss wrong at step 0 is a kernel or a collective; gradients wrong while the loss of
    their step is bitwise equal were computed wrong (exact lane); else the update or a collective carrying weights."""
    loss = comparison.finding("loss")
    if loss is not None and loss.step == 0:
        return "kernel or collective"
    return "collective or kernel" if gradients_moved_first(comparison.findings, comparison.lane) \
        else "optimizer or collective"


def _reordered(finding: Finding, comparison: Comparison) -> str | None:
    """Where the run registers its parameters in another order (the exact lane) and no step-0 gradient moved: sums
    over the parameters (the clip's norm, the recorded norms) follow the order; the model's code changed."""
    if not comparison.reordered or comparison.lane != "exact" or comparison.finding("step0_grad") is not None:
        return None
    return "model"


def _metric(names: tuple[str, ...], component: str) -> Callable[[Finding, Comparison], str | None]:
    return lambda finding, comparison: component if finding.metric in names else None


def _has(fact: str, component: str) -> Callable[[Finding, Comparison], str | None]:
    return lambda finding, comparison: component if finding.facts.get(fact) else None


@dataclass(frozen=True)
class FindingRule:
    id: str
    evidence: str  # in the docs' words
    component: str  # in the docs' words
    decide: Callable[[Finding, Comparison], str | None]


# Read top to bottom for each finding: the first rule that decides names it.
FINDING_RULES: tuple[FindingRule, ...] = (
    FindingRule("resume-load", "the load of the reference's checkpoint failed, or a piece of state it gave back is "
                "not what was saved (a checkpoint is a copy on every stack)", "checkpoint",
                _metric(("resume_load", "resume_state"), "checkpoint")),
    FindingRule("follows-broken-load", "a resumed run's difference, where the load gave back other state",
                "checkpoint", _has("after_broken_load", "checkpoint")),
    FindingRule("layout", "the model's parameter layout differs from the reference's; a tie the library built "
                "against the model's config; only LoRA adapters differ (peft builds them)",
                "model; library: <the package that built it>; library: peft", _layout),
    FindingRule("data-changed", "the token batches differ from the reference's from some step", "data",
                _metric(("data",), "data")),
    FindingRule("follows-layout", "any difference where the layout changed: the runs start from other weights",
                "what the layout names", _follows_layout),
    FindingRule("follows-data", "a difference from the step the token batches changed on (a failed save or load "
                "excepted)", "data", _follows_data),
    FindingRule("registration-order", "the exact lane, parameters registered in another order and no step-0 gradient "
                "moved: sums over the parameters follow the order", "model", _reordered),
    FindingRule("missing", "a metric or tensor missing, reshaped or of another length than the reference's",
                "unknown", _has("missing", "unknown")),
    FindingRule("round-trip", "a checkpoint's round trip failed, or a tensor it gave back differs bit for bit",
                "checkpoint", _metric((ROUND_TRIP, "checkpoint"), "checkpoint")),
    FindingRule("trained-before-save", "a difference in steps that ran before any save or load", "unknown",
                _has("before_save", "unknown")),
    FindingRule("format-behaviour", "a cast's behaviour (saturation, NaN, rounding) differs from the reference's",
                "format", _metric(("behaviour", "reference"), "format")),
    FindingRule("quantized-results", "a quantized checkpoint's checksums or logits differ from the reference's",
                "quantization", _metric(("quantized", "checksums", "logits"), "quantization")),
    FindingRule("less-precise", "step 0 is further from float64 than the reference's", "kernel or library",
                _metric((PRECISION,), "kernel or library")),
    FindingRule("oracle-moved", "the float64 oracle's step 0 differs from the one kept with the reference",
                "kernel or library", _metric((ORACLE_MOVED,), "kernel or library")),
    FindingRule("clip-moved-first", "the norm after clipping moved before anything else", "optimizer",
                _clip_moved_first),
    FindingRule("step0-sparse-or-dense", "step-0 gradients wrong in a few elements (under 5%, or half the blocks): "
                "a collective; nearly everywhere: a kernel; later findings follow the first step-0 gradient",
                "collective; kernel", _step0),
    FindingRule("later-steps", "step 0's gradients right: a loss wrong at step 0; gradients wrong under a bitwise-"
                "equal loss (exact lane); else a later divergence", "kernel or collective; collective or kernel; "
                "optimizer or collective", _later),
)
ADAMW_NOTE = "; AdamW implementation: "
CLIP_SAID = ", so the clipping itself scaled them wrongly (clip_grad_norm_, or the wrapper's)"


def name_findings(comparison: Comparison) -> Comparison:
    """Name every finding of ``comparison`` by the first rule that decides it; the finding keeps the rule's id. Where
    a finding points at the optimizer, which AdamW implementation ran is said (a bug can live in one only)."""
    for finding in comparison.findings:
        finding.component, finding.rule = _named(finding, comparison)
        if finding.rule == "clip-moved-first" and finding.metric == "clipped_grad_norm" and CLIP_SAID not in finding.message:
            finding.message += f"; the gradients before clipping match at step {finding.step}{CLIP_SAID}"
        if "optimizer" in finding.component and comparison.adamw and ADAMW_NOTE not in finding.message:
            finding.message += f"{ADAMW_NOTE}{comparison.adamw}"
    return comparison


def _named(finding: Finding, comparison: Comparison) -> tuple[str, str]:
    """The component the first rule that decides names, and that rule's id."""
    for rule in FINDING_RULES:
        component = rule.decide(finding, comparison)
        if component is not None:
            return component, rule.id
    raise AssertionError("the last rule, later-steps, names every finding")


def convict(comparison: Comparison, component: str, rule: str) -> None:
    """Name ``component`` on every finding, as the verdict's rule ``rule`` decided: experiments replace what the
    findings alone suggest. The layout and data findings keep their own names: no experiment on this stack undoes
    what the library did to the model's code, or the batches that changed."""
    for finding in comparison.findings:
        if finding.metric not in (LAYOUT, "data"):
            finding.component, finding.rule = component, rule
        if "optimizer" not in finding.component:  # which AdamW ran says nothing of a component cleared of it
            finding.message = finding.message.partition(ADAMW_NOTE)[0]


def judged_against_themselves(comparison: Comparison) -> bool:
    """Whether a finding names a round trip or a format: those are judged against themselves, so a changed library's
    numbers explain none of them away."""
    return any(f.component in ("checkpoint", "format") for f in comparison.findings)


def finding_rules_table() -> list[str]:
    """docs/triage.md's table of the rules that name a comparison's findings."""
    lines = ["| rule | when the finding shows | it names |", "| --- | --- | --- |"]
    return lines + [f"| `{r.id}` | {r.evidence} | `[{r.component}]` |" for r in FINDING_RULES]


# --- an op of step 0 ---------------------------------------------------------------------------------------------


def op_component(moved: FirstMoved | None) -> str | None:
    """What an op that moved points at, by where it sits (``FirstMoved.site``): integers a step read are data, a
    collective's output the collective, the clip and the update the optimizer, other arguments the library whose
    code called it, any other op its kernel. None for a changed op sequence, which convicts nothing by itself, and
    for a float input (a weight or buffer): that is no token batch."""
    site = moved.site if moved is not None else None
    if site == "called otherwise":
        return f"library: {moved.caller or 'the code that calls it'}"  # type: ignore[union-attr]
    return {"tokens": "data", "collective": "collective", "update": "optimizer", "compute": "kernel"}.get(site or "")
