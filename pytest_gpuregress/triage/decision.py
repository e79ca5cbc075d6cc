"""One decision from the evidence: the component a failure points at, by rules read top to bottom.

All of a failing case's evidence is in ``Evidence``; the first rule whose evidence is there decides and the
verdict quotes it. An experiment outranks what the comparison infers, and a version that changed only breaks a
tie (triage/model_code.py). ``RULES`` is docs/triage.md's table. torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..comparison.compare import Comparison, Finding
from ..evidence import model_layout
from ..evidence.oracle_distance import PRECISION_METRIC as PRECISION
from .naming import GRADIENTS, op_component

Experiment = Any  # triage's Experiment (name, status, detail, component, convicts): typed there, read here

# The names of the evidence the run itself gives (triage.own_evidence makes them from its own checks).
INVARIANTS = "collective invariants"
CLIP = "clip"
BISECT = "bisect"
MODEL_CODE = "model code"  # triage/model_code.py: the float64 oracle against the reference's


def first_step(comparison: Comparison) -> int | None:
    """The first step a finding of ``comparison`` is at; None where no finding has a step."""
    return min((f.step for f in comparison.findings if f.step is not None), default=None)


@dataclass
class Evidence:
    """What a failing case shows, by name (``Experiment``s), with the comparison it came from."""

    comparison: Comparison | None
    by_name: dict[str, Experiment] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The rules read ``compared``: no comparison (an experiment's evidence alone) is one with no finding, no op.
        self.compared: Comparison = self.comparison if self.comparison is not None else Comparison("", "", [], [])

    @property
    def mostly_unpaired(self) -> str | None:
        """Where less than half of step 0's ops could be paired with the reference's, how many were: the op that
        introduced the difference was then looked for among too few ops to decide on its own."""
        paired = self.compared.paired_ops
        if paired is None or paired[0] * 2 >= paired[1]:
            return None
        return f"only {paired[0]} of this run's {paired[1]} ops of step 0 could be paired with the reference's"

    @property
    def culprit(self) -> Any:
        """The op of step 0 that introduced the difference (``Comparison.culprit``), as evidence: None where there
        is none, or where too little of step 0 was paired to look for it (``mostly_unpaired``)."""
        return None if self.mostly_unpaired else self.compared.culprit

    @property
    def first_step(self) -> int | None:
        return first_step(self.compared)

    def finding(self, *metrics: str) -> Finding | None:
        return self.compared.finding(*metrics)

    def status(self, name: str) -> str | None:
        found = self.by_name.get(name)
        return found.status if found is not None else None

    def convicting(self, name: str) -> Experiment | None:
        found = self.by_name.get(name)
        return found if found is not None and found.convicts and found.component else None

    def quote(self, *names: str) -> str:
        """The named experiments' results, as a verdict quotes them."""
        return "; ".join(f"{e.name} {e.status}: {e.detail}" for e in map(self.by_name.__getitem__, names))


Decision = tuple[str, str]  # (component, the evidence quoted)


@dataclass(frozen=True)
class Rule:
    id: str  # stable: the verdict, JUnit and the tests name the rule by it, so inserting a rule changes no other
    evidence: str  # what must be there, in the docs' words
    component: str  # what it convicts, in the docs' words
    decide: Callable[[Evidence], Decision | None]


@dataclass(frozen=True)
class Verdict:
    """What triage decided for a failing case. The pipeline, the summary, JUnit and the report read its fields;
    nothing reads the component back out of the text."""

    component: str | None  # None: inconclusive, and the findings keep their own names
    rule: str | None  # the id of the rule that decided; None where none did
    quoted: str  # what the deciding rule read
    evidence: str = ""  # every experiment's result, one clause each

    @property
    def line(self) -> str:
        """The report's verdict line."""
        shown = f"Evidence: {self.evidence}. " if self.evidence else ""
        if self.rule is None:
            return (f"triage verdict: inconclusive (no rule's evidence is there: the experiments neither convict nor "
                    f"clear a component, and the findings keep their own names). {shown}{self.quoted}".rstrip())
        rule = RULE_BY_ID[self.rule]
        quote = "" if not self.quoted or self.quoted in self.evidence else f": {self.quoted}"
        return f"triage verdict: {self.component}. {shown}Decided by rule {rule.id} ({rule.evidence}){quote}"


def _experiment(name: str, status: str | None = None) -> Callable[[Evidence], Decision | None]:
    """The rule of an experiment that convicts (with ``status``: only where it says that)."""
    def decide(evidence: Evidence) -> Decision | None:
        found = evidence.convicting(name)
        if found is None or status not in (None, found.status):
            return None
        return str(found.component), evidence.quote(name)

    return decide


def _data(evidence: Evidence) -> Decision | None:
    changed = evidence.finding("data")
    if changed is not None:
        return "data", changed.message
    culprit = evidence.culprit
    return ("data", culprit.describe()) if op_component(culprit) == "data" else None


def _collective_at_step0(evidence: Evidence) -> Decision | None:
    """The op of step 0 that introduced the difference is a collective's output, its inputs within drift: what
    follows from it (a clip that reads gradients the ranks no longer agree on) decides nothing before it."""
    culprit = evidence.culprit
    if op_component(culprit) != "collective" or evidence.first_step != 0:
        return None
    return "collective", culprit.describe()


def _called_otherwise(evidence: Evidence) -> Decision | None:
    """The op that introduced the difference was called with other non-tensor arguments than in the reference (a
    divisor, a scale, an epsilon): the code that called it changed, whatever kernel ran under it."""
    culprit = evidence.culprit
    if culprit is None or culprit.site != "called otherwise":
        return None
    return str(op_component(culprit)), culprit.describe()


def _world_size_factor(evidence: Evidence) -> Decision | None:
    """Every gradient that differs is exactly the world size times the reference's (or its inverse): a divide by the
    number of ranks skipped or done twice. An AVG that summed (the collective) and a caller that did not divide
    (the library) give the same numbers; where the run's collectives kept their invariants it is the caller."""
    gradients = [f for f in evidence.compared.findings if f.metric in GRADIENTS]
    factors = {f.factor_is for f in gradients}
    if len(factors) != 1 or None in factors:
        return None
    what = (f"{len(gradients)} gradient tensors differ, every element exactly {gradients[0].factor:.6g}x the "
            f"reference's: {gradients[0].factor_is}, a divide by the number of ranks skipped or done twice")
    if evidence.status(INVARIANTS) != "held":
        return "collective or library", (f"{what}, by an AVG that summed (the collective) or by the code that "
                                         "divides (a library); the run's collective invariants would tell them apart")
    what += "; every collective kept its invariants, so the code that divides did it"
    culprit = evidence.culprit  # the op that introduced it: whose code scaled the gradients, where it says
    if culprit is None:
        return "library", what
    package = culprit.entry.package if culprit.entry is not None else None
    return (f"library: {package}" if package else "library"), f"{what}; {culprit.describe()}"


def _one_rank(evidence: Evidence) -> Decision | None:
    """The op that introduced the difference computes (no collective), on one rank only, while the same op of the
    other ranks kept within drift: one device's own compute, whatever N ranks against one says; unless one rank
    replaying every rank's micro-batch did the same (equivalence clean): then it followed that rank's data."""
    culprit = evidence.culprit
    if culprit is None or culprit.entry is None or culprit.world < 2 or culprit.also_on:
        return None
    if culprit.site != "compute" or evidence.status("equivalence") == "clean":
        return None
    return "device", (f"rank {culprit.rank} alone: {culprit.describe()}; the same op of the other "
                      f"{culprit.world - 1} rank{'s' if culprit.world > 2 else ''} kept within drift, and no "
                      "collective had run on its inputs: one device's own compute (a kernel on that GPU, or the GPU)")


def _late_gradients_past_checked_collectives(evidence: Evidence) -> Decision | None:
    """Step S's gradients, recomputed in a fresh process from the reference's state, differ, while every collective
    of the run kept its invariants, the gradients' reduce-scatters included: the backward computed them wrong."""
    if evidence.status("late window") != "differs" or evidence.status(INVARIANTS) != "held":
        return None
    return "kernel", evidence.quote("late window", INVARIANTS)


def _culprit_at_step0(evidence: Evidence) -> Decision | None:
    """The op of step 0 that introduced the difference convicts where its effect is what failed: a forward or
    backward op when step 0 already differs, an optimizer op (its update shows from step 1)."""
    moved = evidence.convicting("first moved op")
    if moved is None or evidence.mostly_unpaired or (evidence.first_step != 0 and moved.component != "optimizer"):
        return None
    return str(moved.component), evidence.quote(moved.name)


def _code_changed(evidence: Evidence) -> Decision | None:
    """That package's code computes otherwise (a norm that lost its float32 upcast runs one cast fewer), whatever
    kernels its new ops reach. Not where one of torch's backends was swapped (SDPA): the kernels' rule decides."""
    comparison = evidence.compared
    if not comparison.changed_code or evidence.first_step != 0 or comparison.swapped_backend:
        return None
    package = comparison.changed_code[0]
    where = "; ".join(comparison.sequence_notes[:2]) or "the op sequence of step 0 changed"
    return f"library: {package}", f"ops of step 0 inserted or removed in {package}'s code: {where}"


def _other_precision(evidence: Evidence) -> Decision | None:
    """Ops inserted in step 0 compute in a dtype no op of the reference's did (bf16 in an fp32 run), and step 0 differs:
    the model runs in another precision than it was recorded in, as under an autocast or a casting wrapper that the
    code preparing the model applied. A kernel that changed computes in the dtypes it is given."""
    comparison = evidence.compared
    if not comparison.new_dtypes or evidence.first_step != 0:
        return None
    where = "; ".join(comparison.sequence_notes[:1]) or "the op sequence of step 0 changed"
    return "library", (f"ops of step 0 now compute in {', '.join(comparison.new_dtypes)}, which no op of the "
                       f"reference did ({where}): an autocast or a casting wrapper runs the model in another precision "
                       "than it was recorded in, set by the code that prepared the model")


def _less_precise_same_code(evidence: Evidence) -> Decision | None:
    """Step 0 is further from float64 than the reference's (a reduced-precision run), through the same ops with the
    same arguments: the same code computed it less precisely, so a kernel under it (a cast that truncates, a GEMM
    that accumulates in bf16)."""
    found = evidence.finding(PRECISION)
    if found is None or (evidence.compared.changed_code and not evidence.compared.swapped_backend):
        return None
    return "kernel", f"{found.message}; the same ops ran, with the same arguments"


def _registration_order(evidence: Evidence) -> Decision | None:
    """Every sum over the parameters (the clip's total norm, the recorded norms) follows the order of registration,
    so its last bits move: the model's code changed; no kernel, collective or update did."""
    comparison = evidence.compared
    if not comparison.reordered or comparison.lane != "exact" or evidence.finding("step0_grad") is not None:
        return None
    return "model", ("this run registers the model's parameters in another order than the reference, and step 0's "
                     "gradients are bitwise the reference's: sums over the parameters (the clip's total norm) follow "
                     "that order, so their last bits move, and the training with them")


def _kernels(evidence: Evidence) -> Decision | None:
    if "kernels" not in evidence.by_name or evidence.first_step != 0:
        return None
    return "kernel", f"{evidence.quote('kernels')} (and step 0 differs)"


def _model_layout(evidence: Evidence) -> Decision | None:
    """The model's parameter layout differs from the reference's (its code changed), or the library built another
    model than its config asks: the runs start from other weights, so no number of theirs can be compared."""
    layout = evidence.finding(model_layout.METRIC)
    if layout is None:
        return None
    why = f"{model_layout.BUILT_OTHERWISE} (the first finding)" if model_layout.is_tie(layout.metric, layout.facts) \
        else "the model's parameter layout differs from the reference's"
    return layout.component, f"{why}, so the runs start from other weights"


def _step0_gradients_either(evidence: Evidence) -> Decision | None:
    """Step-0 gradients moved in a scenario that ran neither equivalence nor the oracle (LoRA, a resume): nothing
    tells a kernel from a collective, and which gradients moved (their sparsity) is no evidence."""
    if {"equivalence", "oracle"} & set(evidence.by_name) or not any(
            f.metric == "step0_grad" and f.component in ("kernel", "collective") for f in evidence.compared.findings):
        return None
    return "kernel or collective", ("step-0 gradients moved, and this scenario has no equivalence or oracle experiment "
                                    "to tell a kernel from a collective; which step-0 gradients moved is no evidence")


RULES: tuple[Rule, ...] = (
    Rule("bisect", "a bisect of the upgrade: reverting one package (or a group) restores step 0", "library: <that package>",
         _experiment(BISECT)),
    Rule("data", "the token batches differ from the reference's (integers do not drift)", "data", _data),
    Rule("collective-invariants",
         "a collective broke its own invariant in this run (bit-identical outputs, sums kept) at some step",
         "collective", _experiment(INVARIANTS)),
    Rule("collective-at-step0",
         "the op of step 0 that introduced the difference is a collective's output, its inputs within drift (step 0 "
         "differs)", "collective", _collective_at_step0),
    Rule("clip", "the clip is inconsistent with its own norm (another norm than the gradients', or another coefficient)",
         "optimizer", _experiment(CLIP)),
    Rule("called-otherwise",
         "the op that introduced the difference was called with other arguments than the reference's (a divisor, a "
         "scale, an epsilon)", "library: <the package whose code called it>", _called_otherwise),
    Rule("world-size-factor",
         "every gradient that differs is exactly the world size times the reference's, or its inverse (a divide by the "
         "number of ranks skipped or done twice)", "collective or library; library (the package whose code ran the op "
         "that introduced it) where the collectives kept their invariants", _world_size_factor),
    Rule("one-rank", "the op that introduced the difference computes, on one rank only; the others' same op kept within drift; "
         "one rank replaying every rank's micro-batch did not compute it (equivalence not clean)",
         "device (the rank named)", _one_rank),
    Rule("oracle", "the float64 oracle on this stack (no collective) differs from this stack's own one-rank run",
         "kernel", _experiment("oracle")),
    Rule("equivalence", "N ranks differ from one rank on the same batch (equivalence)", "collective", _experiment("equivalence")),
    Rule("late-gradients-past-held-collectives",
         "the late window: step S's gradients, from the reference's own state, differ, while every collective of the "
         "run kept its invariants, the gradients' reduce-scatters included", "kernel",
         _late_gradients_past_checked_collectives),
    Rule("late-window-differs",
         "the late window: step S's gradients, from the reference's own state, differ", "collective, or kernel or "
         "collective", _experiment("late window", "differs")),
    Rule("model-code",
         "the float64 oracle on this stack differs from the one recorded with the reference: the model's code computes "
         "another function", "library: <the package whose code called or ran the op that moved>; kernel where that op "
         "had the reference's inputs and arguments", _experiment(MODEL_CODE)),
    Rule("culprit-at-step0",
         "the op of step 0 that introduced the difference (step 0 differs, or an optimizer op)", "its component",
         _culprit_at_step0),
    Rule("registration-order",
         "the exact lane: the run registers the model's parameters in another order (the same names and shapes), and "
         "step 0's gradients are bitwise the reference's", "model", _registration_order),
    Rule("late-window-reproduced",
         "the late window reproduced it: right gradients at S, and the update from the reference's state diverges "
         "again in a fresh process", "optimizer", _experiment("late window", "reproduced")),
    Rule("other-precision",
         "ops inserted in step 0 compute in a dtype no op of the reference did (bf16 in an fp32 run), and step 0 "
         "differs", "library (the code that prepared the model: an autocast or a casting wrapper)", _other_precision),
    Rule("code-changed",
         "ops of step 0 were inserted or removed in one package's code (not merely relabelled, no backend of torch's "
         "swapped), and step 0 differs", "library: <that package>", _code_changed),
    Rule("less-precise-same-ops",
         "a reduced-precision step 0 is further from float64 than the reference's, through the same ops", "kernel",
         _less_precise_same_code),
    Rule("kernels-changed", "the ops of step 0 now run other kernels, and step 0 differs", "kernel", _kernels),
    # Where no experiment and no op decided: what the findings themselves say.
    Rule("model-layout", "the model's parameter layout differs from the reference's (its code changed, or the library "
         "built another model than its config asks)", "model (or the library that built it)", _model_layout),
    Rule("step0-gradients-either", "step-0 gradients moved in a scenario that runs no equivalence or oracle",
         "kernel or collective", _step0_gradients_either),
)
RULE_BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}


def decide(evidence: Evidence, summary: str = "", rules: tuple[Rule, ...] = RULES) -> Verdict:
    """The verdict of the first rule (of ``rules``) whose evidence is there; inconclusive where none is. ``summary``:
    every experiment's result, quoted by the verdict."""
    for rule in rules:
        found = rule.decide(evidence)
        if found is not None:
            return Verdict(found[0], rule.id, found[1], summary)
    unpaired = evidence.mostly_unpaired
    known = f"{unpaired}, so the op that introduced the difference decides nothing alone" if unpaired else ""
    return Verdict(None, None, "; ".join(filter(None, [known, _what_would_settle(evidence)])), summary)


def _what_would_settle(evidence: Evidence) -> str:
    """For an inconclusive verdict: the experiment that would settle it, where the evidence says which."""
    late = evidence.status("late window")
    flips = "" if any(name.startswith("flip ") for name in evidence.by_name) else (
        "--gpuregress-triage reruns the whole training with one switch flipped at a time (world size 1 clears or "
        "convicts the collectives, a lower CPU kernel path or the other BLAS the kernels)")
    if late == "did not reproduce" and flips:
        return f"what would settle it: the divergence needs a warmed-up process, which a replay from a checkpoint is " \
               f"not; {flips}"
    if late == "reproduced later":
        exact = "" if evidence.compared.lane == "exact" else ("a run on the reference's own stack, where the exact lane "
                                                              "sees the step whose bits move first (an update's move at "
                                                              "the window's first step); ")
        return f"what would settle it: {exact}{flips}".rstrip("; ")
    return ""


BEGIN, END = "<!-- decision-rules:begin -->", "<!-- decision-rules:end -->"


def markdown_table() -> list[str]:
    """docs/triage.md's table of the rules, in their order."""
    lines = ["| rule | when the evidence shows | the verdict |", "| --- | --- | --- |"]
    lines += [f"| `{rule.id}` | {rule.evidence} | `[{rule.component}]` |" for rule in RULES]
    lines.append("| (none) | none of these | inconclusive: what is known is said, and the findings keep their own names |")
    return lines
