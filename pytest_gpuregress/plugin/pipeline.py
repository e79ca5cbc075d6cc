"""One case's data flow, top to bottom: record it, or read its reference, judge it (the scenario's comparator),
keep what a later look needs, write its summary row and figures, warn, explain a failure, and report.

The judgement itself is the comparator's (scenarios/comparator.py): this module only acts on it. What a comparison
leaves behind (``Artifacts``): ``runs/<name>/<platform-key>/`` (the run, for ``gpuregress compare``) and its
``.png`` plot; a failed run is always kept and plotted, a passed one only with --gpuregress-keep-runs or --gpuregress-plots.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..comparison import perf
from ..comparison.compare import Comparison, tolerant_limits
from ..comparison.judgement import Judgement
from ..comparison.plot import PlotsUnavailable, first_divergence, plot_comparison
from ..comparison.report import format_comparison, format_drift, format_margins
from ..errors import MissingReference, ReferenceProblem, RegressionFailure
from ..evidence import clipping, oracle_distance
from ..findings import Problem
from ..reference import store
from ..reference.record import RunRecord
from ..scenarios.comparator import Comparator, with_identity
from ..stack.fingerprint import describe_change
from ..triage.explain import Explanation
from ..triage.naming import component_of, convict, described, name_findings
from ..warn import warn_at_test
from .options import Options
from .outcomes import Outcome, add_outcome
from .places import ReferencePlaces

# (the reference as compared, the comparison, the reference whole, the run) -> triage's verdict and report lines
Explain = Callable[[RunRecord, Comparison, RunRecord, RunRecord], Explanation]


@dataclass
class Kept:
    """Where a comparison's run and plot went, or why there is no plot."""

    run: Path | None = None
    plot: Path | None = None
    plot_note: str | None = None

    def report_lines(self, reference: Path) -> list[str]:
        lines = []
        if self.run is not None:
            lines.append(f"this run's record: {self.run}")
            lines.append(f"reproduce the comparison: {compare_command(reference, self.run)}")
        if self.plot is not None:
            lines.append(f"plot: {self.plot}")
        elif self.plot_note:
            lines.append(f"plot: none ({self.plot_note})")
        return lines


def compare_command(reference: Path | None, run: Path) -> str:
    """The command that judges ``run`` again as the plugin did: against ``reference``, or alone for a check case."""
    return shlex.join(["gpuregress", "compare", *([str(reference)] if reference is not None else []), str(run)])


class Artifacts:
    def __init__(self, root: Path) -> None:
        self.root = root / "runs"

    def keep_run(self, name: str, record: RunRecord) -> Path:
        return store.write_reference(store.ReferenceLocation(self.root, name, record.platform_key), record, overwrite=True)

    def keep(self, name: str, record: RunRecord, reference: RunRecord, comparison: Comparison, *,
             keep_run: bool, plot: bool) -> Kept:
        kept = Kept()
        if keep_run:
            kept.run = self.keep_run(name, record)
        if not plot or not record.series:
            return kept
        try:
            kept.plot = plot_comparison(reference, record, self.root / name / f"{record.platform_key}.png", comparison,
                                        title=name)
        except PlotsUnavailable as exc:
            kept.plot_note = str(exc)
        except Exception as exc:  # noqa: BLE001 - the findings matter more than their picture
            kept.plot_note = f"the plot failed: {type(exc).__name__}: {exc}"
        return kept



class CheckPipeline:
    def __init__(self, places: ReferencePlaces, artifacts: Artifacts, outcomes: list[Outcome], figures: dict[str, Any],
                 writes_references: Callable[[], bool], options: Options) -> None:
        self.places = places
        self.artifacts = artifacts
        self.outcomes = outcomes
        self.figures = figures  # the current test's key figures (cleared per test by the plugin)
        self.writes_references = writes_references  # False on torchrun ranks other than 0
        self.options = options  # keep_runs, plots, record_anyway (over a reference closer to float64 too)
        self._recorded: dict[Any, RunRecord] = {}

    def check(self, record: RunRecord, name: str, comparator: Comparator, extra: list[str],
              explain: Explain | None = None, kept_as: str | None = None) -> Comparison | None:
        """Record ``record`` as reference ``name``, or judge it against that reference; raise on a failure.

        ``extra``: failures found before judging (faults that never fired, a user's own findings).
        ``kept_as``: the name the run is kept under (default ``name``): the case's id, where cases share a reference."""
        __tracebackhide__ = True
        if self.places.recording(name, record.platform_key):
            self._record(record, name, [*extra, *map(described, comparator.own_checks(record))])
            return None
        loc, reference = self._reference(name, record)
        judgement = comparator.judge(reference, record)
        comparison = judgement.comparison
        assert comparison is not None  # judged with a reference
        name_findings(comparison)
        problems = [*extra, *map(described, judgement.problems)]
        self._named(judgement.problems, comparison)
        passed = comparison.passed and not problems
        kept = self.artifacts.keep(kept_as or name, with_identity(record, comparator), judgement.reference or reference,
                                   comparison, keep_run=not passed or self.options.keep_runs, plot=not passed or self.options.plots)
        self._summarise(comparator.row_label(name), record, loc.path, judgement, kept, passed)
        if passed:
            return comparison
        why = f"(the comparison with the reference {loc.path} passed)" if comparison.passed \
            else self._report(name, record, loc, reference, judgement, explain)
        raise RegressionFailure("\n".join([*problems, why, *kept.report_lines(loc.path)]))

    def _reference(self, name: str, record: RunRecord) -> tuple[store.ReferenceLocation, RunRecord]:
        """Where reference ``name`` is read, and the reference, checked to be comparable with ``record``."""
        loc = self.places.location(name, record.platform_key)
        try:
            reference = store.read_reference(loc)
            store.check_compatible(loc, reference, record)
        except ReferenceProblem as exc:  # missing, corrupt or foreign: a row in the closing table too
            self.unusable(exc, name, record.platform_key, loc)
            raise
        return loc, reference

    def _report(self, name: str, record: RunRecord, loc: store.ReferenceLocation, reference: RunRecord,
                judgement: Judgement, explain: Explain | None) -> str:
        """A failed comparison's report, explained by triage where the case has an explainer."""
        comparison = judgement.comparison
        assert comparison is not None
        evidence: list[str] = []
        if explain is not None and comparison.findings:
            # The reference as compared (cut to the steps a fail-fast run ran), and whole: the late window reads
            # the reference's late steps.
            evidence = self._explained(explain(judgement.reference or reference, comparison, reference, record),
                                       comparison)
        self._named(judgement.problems, comparison)  # the verdict may have convicted one component for every finding
        report = format_comparison(comparison, scenario=name, platform_key=record.platform_key,
                                   reference_path=str(loc.path), record_hint=loc.record_hint,
                                   record_elsewhere_hint=loc.record_elsewhere_hint) + "\n".join(evidence)
        if comparison.findings and judgement.observed is not None:  # a deviation: what the kernels did sits next to it
            report += "\n" + "\n".join(judgement.observed.evidence())
        return report

    def _explained(self, explained: Explanation, comparison: Comparison) -> list[str]:
        """Triage's verdict convicts its component and goes to the test's figures; its evidence is the report's."""
        verdict = explained.verdict
        if verdict is not None:
            if verdict.component and verdict.rule:
                convict(comparison, verdict.component, verdict.rule)
            self.figures.update(triage_verdict=verdict.line, triage_rule=verdict.rule)
        self.figures["bisect"] = explained.bisect
        return explained.lines

    def unusable(self, exc: ReferenceProblem, name: str, platform_key: str, loc: store.ReferenceLocation) -> None:
        """The closing table's row for a reference that cannot be used, with the command that records it."""
        detail = "no reference" if isinstance(exc, MissingReference) else type(exc).__name__
        add_outcome(self.outcomes, Outcome(name, platform_key, "error", detail=detail, reproduce=loc.record_hint))

    def check_without_reference(self, record: RunRecord, name: str, comparator: Comparator, extra: list[str],
                                judged: Callable[[bool], None] = lambda passed: None) -> None:
        """Judge a case that has no reference (a check case). A failed run is kept, with the command that judges
        it again; a passed one with --gpuregress-keep-runs. ``judged`` hears whether the case's own checks passed
        (``extra``, such as a fault that never fired, left out)."""
        __tracebackhide__ = True
        found = comparator.judge(None, record).problems
        own = [described(problem) for problem in found]
        self._named(found)
        judged(not own)
        problems = [*extra, *own]
        if not problems and not self.options.keep_runs:
            return
        kept = self.artifacts.keep_run(name, with_identity(record, comparator))
        if not problems:
            return
        raise RegressionFailure("\n".join([*problems, f"this run's record: {kept}",
                                           f"reproduce the verdict: {compare_command(None, kept)}"]))

    def _named(self, problems: list[Problem], comparison: Comparison | None = None) -> None:
        """The components a case's findings name, as triage named them: JUnit's ``component`` property, and what a
        failed case's known issues are matched by (plugin/reporting.py)."""
        findings = comparison.findings if comparison is not None else []
        named = [*filter(None, map(component_of, problems)), *(f.component for f in findings)]
        if named:
            self.figures["component"] = ", ".join(dict.fromkeys(named))

    def _record(self, record: RunRecord, name: str, problems: list[str]) -> None:
        if problems:  # never store a reference that fails its own checks
            raise RegressionFailure(f"not recording {name!r}: the run fails its own checks\n" + "\n".join(problems))
        loc = self.places.location(name, record.platform_key, for_writing=True)
        if not self.writes_references() or self._recorded.get(loc.path) is record:  # cases sharing one reference
            return
        clip = clipping.of(record)
        notes = [*record.notes, *self._toward_the_truth(loc, name, record)]
        notes += [clip.warning() or clip.describe()] if clip is not None else []
        path = store.write_reference(loc, record, overwrite=True)
        self._recorded[loc.path] = record
        self.outcomes.append(Outcome(name, record.platform_key, "recorded", detail=str(path), notes=notes))

    def _toward_the_truth(self, loc: store.ReferenceLocation, name: str, record: RunRecord) -> list[str]:
        """Refuse to replace a reference with a run further from float64 (evidence/oracle_distance.py);
        notes for the recorded line otherwise."""
        if not (loc.path / store.MANIFEST).exists():
            return []  # a first recording stores its distance without judging it
        try:
            old = store.read_reference(loc)
        except ReferenceProblem:  # a damaged reference vouches for nothing: replace it
            return ["the reference replaced could not be read, so the distance from float64 was not judged"]
        judged = oracle_distance.judge_rerecording(old, record, tolerant_limits(old)[0]["step0_grad"])
        if not judged.allowed and not self.options.record_anyway:
            raise RegressionFailure(judged.refusal(name, record.platform_key))
        overridden = f" ({oracle_distance.OVERRIDE_FLAG}: recorded anyway)" if not judged.allowed else ""
        return [f"re-recorded: {judged.reason}{overridden}"]

    def _summarise(self, name: str, record: RunRecord, reference_path: Any, judgement: Judgement, kept: Kept,
                   passed: bool) -> None:
        """The closing table's row, the test's figures, and the observations' warnings."""
        comparison, observed = judgement.comparison, judgement.observed
        assert comparison is not None and observed is not None
        # The closing table's row, with the command that judges a failed run again.
        outcome = Outcome(name, record.platform_key, "passed" if passed else "failed", comparison.lane,
                          _detail(record, reference_path, comparison, observed.detail(), passed),
                          [*record.notes, *comparison.notes], max(comparison.margins.values(), default=None),
                          record.timings.get("launch_wall_s"),
                          compare_command(reference_path, kept.run) if kept.run and not passed else "")
        add_outcome(self.outcomes, outcome)
        self.figures.update(lane=comparison.lane, platform_key=record.platform_key,
                            first_differing_step=first_divergence(comparison), worst_over_tolerance=outcome.worst,
                            seconds=outcome.seconds, plot=kept.plot,
                            stack_changes=[describe_change(*c) for c in comparison.stack_changes] or ["none"],
                            perf=perf.summary(observed.ratios) or None,
                            kernel_changes=None if observed.kernel_changes is None else len(observed.kernel_changes))
        # Warned once the outcome is kept: under -W error a warning raises, and must not lose the summary row.
        for category, message in observed.warnings():
            warn_at_test(category(f"{name} {record.platform_key}: {message}"))


def _detail(record: RunRecord, reference_path: Any, comparison: Comparison, observed: str, passed: bool) -> str:
    """The summary row's detail: what the run did and its reference, then the margins, what the kernels did, the
    tolerant lane's reason and, on a pass whose ops moved, where bitwise drift starts (outcomes.outcome_lines)."""
    loss, clip = record.series.get("loss"), clipping.of(record)
    did = [f"{record.steps} steps, loss {loss[0]:.4f} -> {loss[-1]:.4f}" if loss else "",
           clip.describe() if clip is not None else "", f"reference {reference_path}"]
    more = [format_margins(comparison) if comparison.margins else "", observed,
            comparison.lane_reason if comparison.lane == "tolerant" else "", format_drift(comparison) if passed else ""]
    return "; ".join(filter(None, [", ".join(filter(None, did)), *more]))
