"""Triage's experiments used by the session: on a failed comparison, to convict a component in place of the
heuristic's guess; on a recording, the float64 oracle's distance stored with the reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..comparison.compare import Comparison, Finding
from ..errors import NotApplicable
from ..evidence.op_trace import STACK_CONFIG, STACK_KEY
from ..reference.record import RunRecord
from ..scenarios import Case, Launch, Scenario, Setup
from . import Experiment, Runner, cheap_evidence, divergence_start, model_code, model_suffix, report, verdict
from . import late_window as window
from .bisect import BisectRequest, bisect_failure
from .decision import RULE_BY_ID
from .flips import flip
from .naming import judged_against_themselves

if TYPE_CHECKING:
    from ..evidence.first_moved import FirstMoved
    from .decision import Verdict


@dataclass
class Explanation:
    """What triage made of a failed comparison: its verdict (None where triage could not run, or where a round trip's
    or a format's finding keeps its own name), the report's lines, and the bisect's line where one ran."""

    verdict: Verdict | None
    lines: list[str]
    bisect: str | None = None


def explain_failure(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, comparison: Comparison,
                    model: str | None, flips: bool, run_experiments: bool = True,
                    case: Case | None = None, checks: Sequence[Experiment] = (),
                    whole_reference: RunRecord | None = None,
                    bisect: BisectRequest | None = None) -> Explanation:
    """The verdict on a failed comparison, with the report's lines of evidence (docs/triage.md). ``checks``: what the
    session's check scenarios say; ``whole_reference``: ``reference`` as stored, uncut by fail-fast or a continuation's
    first step (its results keep the oracle). A code change decides only
    where no experiment convicts this stack: an upgrade's kernel bug must not be buried under "record a reference"."""
    from ..evidence import model_layout

    # The layout finding: the model's code changed, or the library built another model than the config asks.
    layout = comparison.finding(model_layout.METRIC)
    full = whole_reference or reference
    library = None if layout is not None else model_code.experiment(sc, setup, run, full, model, comparison)
    if not run_experiments:
        evidence = [*checks, *_bisected(sc, setup, run, full, comparison, case, bisect)]
        return _layout_decides(comparison, layout, evidence) or _without_experiments(library, comparison, evidence)
    try:
        # Equivalence and the oracle need no reference: even where the model's code changed, they can still
        # convict a collective or a kernel of this stack, which re-recording must not bury.
        experiments = [*cheap_evidence(sc, setup, run, model), *checks]
        decided = _layout_decides(comparison, layout, experiments)  # then the costlier experiments are not run
        if decided is not None:
            return decided
        experiments += _late_window_of(sc, setup, run, full, comparison, case, experiments)
        if library is not None:  # the float64 oracle moved: evidence the decision weighs (triage/decision.py)
            experiments.append(library)
        if flips and layout is None:  # flips compare with a reference, which a changed layout cannot judge
            experiments += flip(sc, setup, run, reference, comparison, model)
        experiments += _bisected(sc, setup, run, full, comparison, case, bisect)
    except Exception as exc:  # noqa: BLE001 - triage must never hide the regression it explains
        return Explanation(None, ["", f"triage could not run ({_first_line(exc)}); components are the heuristic's"])
    found = verdict(comparison, experiments)
    keep_first_moved_stack(sc, setup, run, comparison, model, rerun=flips)
    return _explained(found, experiments)


def _layout_decides(comparison: Comparison, layout: Finding | None,
                    evidence: list[Experiment]) -> Explanation | None:
    """Where the parameter layout changed and no evidence convicts this stack, the layout's rule decides: the runs
    start from other weights, so nothing after step 0 can be judged."""
    if layout is None or any(e.convicts for e in evidence):
        return None
    found = verdict(comparison, evidence, rules=(RULE_BY_ID["model-layout"],))
    return Explanation(found, report(found.line, evidence))


def _late_window_of(sc: Scenario, setup: Setup, run: Runner, full: RunRecord, comparison: Comparison,
                    case: Case | None, so_far: list[Experiment]) -> list[Experiment]:
    """The late window of ``case`` where step 0 is cleared and a later step differs (triage/late_window.py)."""
    first = divergence_start(comparison, so_far)
    if first is None or case is None:
        return []
    return late_window(sc, setup, run, full, case, comparison.lane, first)


def _explained(found: Verdict, experiments: Sequence[Experiment]) -> Explanation:
    """The verdict and the report's lines, with the ``bisect:`` line where a bisect ran."""
    ran = next((e for e in experiments if e.name == "bisect"), None)
    bisected = [] if ran is None else [f"bisect: {ran.detail}" if ran.status in ("named", "no revert restores")
                                       else f"bisect {ran.status}: {ran.detail}"]
    return Explanation(found, [*report(found.line, list(experiments)), *bisected], bisected[0] if bisected else None)


def _bisected(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, comparison: Comparison,
              case: Case | None, bisect: BisectRequest | None) -> list[Experiment]:
    """The bisect's evidence where --gpuregress-bisect asks for it: [] otherwise."""
    if bisect is None or case is None:
        return []
    return [bisect_failure(sc, setup, run, reference, comparison, case, bisect)]


def _without_experiments(library: Experiment | None, comparison: Comparison,
                         evidence: list[Experiment]) -> Explanation:
    """For a scenario triage runs no experiments for (lora, a resume): the decision from the run's own checks, its
    first moved op, the model's code and a bisect. A round trip's or a format's finding keeps its own name."""
    if judged_against_themselves(comparison):
        return Explanation(None, ["", f"also: {library.detail}"] if library is not None else [])
    if library is not None:
        evidence = [*evidence, library]
    return _explained(verdict(comparison, evidence), evidence)


def late_window(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, case: Case, lane: str,
                first_step: int) -> list[Experiment]:
    """The late window's experiment, where ``case`` has a resume case continuing its reference from the
    reference's late checkpoint; [] where it has none. Its launch is the resume case's own: run once per session
    for both."""
    from ..scenarios.shared import late_gradients, resume_comparison, resume_plan

    resume = resume_plan.late_window_case(sc, case, setup)
    saved = reference.results.get(resume_comparison.SAVED_KEY)
    if resume is None or not saved:
        return []
    try:
        record = sc.from_reference(resume, lambda: reference, run, setup)
        if record is None:
            return []
        compared = late_gradients.has_late(reference) and late_gradients.has_late(record)
        return [window.judged(first_step, int(saved["step"]), sc.compare(reference, record, resume, lane), compared)]
    except NotApplicable as exc:
        return [Experiment(window.NAME, "not applicable", str(exc))]
    except Exception as exc:  # noqa: BLE001 - one experiment that failed must not take the others' evidence with it
        return [Experiment(window.NAME, "failed to run", _first_line(exc))]


def keep_first_moved_stack(sc: Scenario, setup: Setup, run: Runner, comparison: Comparison, model: str | None,
                           rerun: bool) -> None:
    """The Python stack of the first op that moved, from step 0 re-run on this stack (``rerun``: with
    --gpuregress-triage, whose launches it joins), into the comparison's report; else how to get it."""
    moved = comparison.culprit
    if moved is None or moved.kind != "moved":
        return
    if not rerun:
        moved.stack.append("its Python stack: add --gpuregress-triage, which re-runs step 0 to keep it")
        return
    try:
        moved.stack.extend(keep_stack(sc, setup, run, moved, model))
    except Exception as exc:  # noqa: BLE001 - a stack is a help for the bug report, never worth losing the failure
        moved.stack.append(f"its Python stack: the re-run of step 0 failed ({type(exc).__name__}: {exc})")


def keep_stack(sc: Scenario, setup: Setup, run: Runner, moved: FirstMoved, model: str | None = None) -> list[str]:
    """The lines to report of the first op that moved: its Python stack, and for a backward op where its autograd
    node was made, from step 0 re-run keeping that one op's stack on its rank (evidence/op_tracer.py)."""
    config = {**sc.model_config(setup, model), "steps": 1, STACK_CONFIG: [moved.rank, moved.entry_index]}
    kept = run(sc, Launch(f"op-stack-{moved.rank}-{moved.entry_index}{model_suffix(model)}", config)).results.get(STACK_KEY)
    if not kept:
        return ["its Python stack: the re-run of step 0 kept none"]
    expected = moved.entry.op if moved.entry is not None else None
    if kept.get("op") != expected:  # the re-run's ops came in another order: its stack would be another op's
        return [f"its Python stack: the re-run of step 0 ran {kept.get('op')} there, not {expected}: not kept"]
    lines = ["its Python stack (step 0 re-run on this stack):", *_frames(kept["stack"])]
    if kept.get("forward_stack"):
        lines += ["where its autograd node was made, in the forward:", *_frames(kept["forward_stack"])]
    return lines


def _frames(stack: list[str]) -> list[str]:
    return [line.rstrip() for frame in stack for line in frame.splitlines() if line.strip()]


def measure_oracle_distance(sc: Scenario, setup: Setup, run: Runner, record: RunRecord, model: str | None) -> None:
    """Store in ``record`` its step-0 distance from the float64 oracle (evidence/oracle_distance.py) and the
    oracle's own step 0 (evidence/oracle_step0.py), which later runs hold theirs against."""
    from ..evidence import oracle_distance, oracle_step0

    oracle = model_code.oracle_launch(sc, setup, model)
    # Cases sharing one launch: measured once.
    if oracle is not None and record.results.get(oracle_distance.RESULT_KEY) is None:
        oracle_record = run(sc, oracle)
        oracle_distance.attach(record, oracle_record)
        oracle_step0.attach(record, oracle_record)


def _first_line(exc: Exception) -> str:
    """An exception as an experiment that failed says it: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
