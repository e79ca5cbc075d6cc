"""The ``gpuregress`` fixture's public face, and the one test of the built-in suite.

It holds ``Selection``, ``ReferencePlaces``, ``Launches`` and ``CheckPipeline`` (docs/architecture.md).
Nothing here names a scenario.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..comparison.compare import Comparison
from ..comparison.judgement import JudgingPolicy
from ..errors import GpuRegressError, NotSupported, RankFailure, ReferenceProblem
from ..evidence import oracle_distance
from ..faults import check_ranks, firing
from ..reference import store
from ..reference.record import RunRecord
from ..scenarios import Case, Launch, Scenario, Setup, get_scenario
from ..scenarios.comparator import Comparator, comparator_of
from ..stack.platforms import Platform, rank_origin, resolve_platform
from ..triage import own_evidence, session_checks
from ..triage.bisect import BisectRequest
from ..triage.explain import Explanation, explain_failure, measure_oracle_distance
from .launches import Launches, Runner, keeping
from .options import Options
from .outcomes import Outcome, add_outcome
from .pipeline import Artifacts, CheckPipeline, Explain
from .places import ReferencePlaces
from .selection import Selection, test_id


class GpuRegressSession:
    def __init__(self, options: Options, rootpath: Path, output_dir: Path | None = None) -> None:
        self.options = options
        # Failed runs, plots, rank logs and check scenarios' records go here (named in the header).
        self.output_dir: Path = options.artifacts or output_dir or Path(tempfile.mkdtemp(prefix="gpuregress-artifacts-"))
        self.platform: Platform = resolve_platform(options.device, options.world_size)
        check_ranks(options.faults, self.platform.world_size, rank_origin(self.platform, options.world_size))
        self.setup = Setup(device_kind=self.platform.device_kind, backend=self.platform.backend,
                           world_size=self.platform.world_size, steps=options.steps, faults=options.faults,
                           options=dict(options.scenario_values), tokens=options.tokens, models=options.models,
                           replicas=options.replicas)
        self.policy = JudgingPolicy(lane=options.lane, kernel_changes=options.kernel_changes, perf=options.perf,
                                    perf_slowdown=options.perf_slowdown, perf_memory=options.perf_memory)
        self.figures: dict[str, Any] = {}  # the current test's key figures, for JUnit properties and HTML extras
        self.outcomes: list[Outcome] = []
        # Check cases that are evidence on other failures (the collective sweep): name -> (passed, failed ids).
        self.checked: dict[str, tuple[int, list[str]]] = {}
        self.known_issues: list[Any] = []  # stack/known_issues.py: set at configure time, matched in the header
        self.matched_issues: list[Any] | None = None  # those of this stack (the header's): a failed case cites them
        self.selection = Selection(self.setup, self.platform, options.world_size, options.inject)
        self.places = ReferencePlaces(options, rootpath, self.selection)
        self.launches = Launches(options, self.platform, self.setup, self.selection, self.output_dir)
        self.pipeline = CheckPipeline(self.places, Artifacts(self.output_dir), self.outcomes, self.figures,
                                      lambda: self.launches.writes_references, options)

    def close(self) -> None:
        self.launches.close()

    # --- the fixture's API -------------------------------------------------------------------------

    def run(self, scenario: str | Scenario, *, config: dict[str, Any] | None = None, faults: list[str] | None = None,
            env: dict[str, str] | None = None, reference: str | None = None) -> RunRecord:
        """Run ``scenario`` (a name, "module:function", or a Scenario) on every rank; return the merged record.

        ``reference``: the name ``check`` will compare the record with. Given it, the run works as the built-in
        scenarios do: --gpuregress-fail-fast hands the ranks the reference to stop at the first miss, and
        --gpuregress-record also runs the noise replicas whose spread is stored as the envelope."""
        sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
        launch = Launch("default", {**sc.default_config(self.setup), **(config or {})}, dict(env or {}))
        self.launches.watches.pop((sc.name, launch.key), None)  # an earlier run's reference is not this one's
        faults = faults or []
        if reference is not None and self._fails_fast:
            self._watch(sc, launch, reference, Comparator(self.policy))
        record = self.launches.launch(sc, launch, faults)
        if reference is not None and self.places.recording(reference, record.platform_key) and self.options.replicas:
            self.launches.add_envelope(sc, launch, record, faults)
        return record

    def check(self, record: RunRecord, *, name: str | None = None, extra: list[str] | None = None) -> Comparison | None:
        """Record ``record`` (with --gpuregress-record) or compare it with its reference ``name`` (default: the
        scenario's name) on losses, gradients and weights.

        ``extra``: findings of your own, reported with the comparison's. Raises RegressionFailure with the full
        report when it differs; MissingReference, CorruptReference or ForeignReference when the reference cannot
        be used."""
        __tracebackhide__ = True
        extra = extra or []
        unfired = [p for p in self._faults_unfired([record.results]) if p not in extra]
        return self.pipeline.check(record, name or record.scenario, Comparator(self.policy), [*extra, *unfired])

    def check_metrics(self, name: str, *, loss: Any, grad_norm: Any = None, clipped_grad_norm: Any = None,
                      param_grad_norms: Any = None, tensors: Any = None, rtol: float | dict[str, float] | None = None,
                      replicas: Any = (), platform: str = "metrics") -> Comparison | None:
        """Record (with --gpuregress-record) or compare metrics a job of your own produced, as ``num_regression.check``.

        Arguments: comparison/metrics.py and docs/own-models.md. ``rtol`` puts the comparison in the tolerant lane."""
        __tracebackhide__ = True
        from ..comparison import envelope
        from ..comparison.metrics import metrics_record, tolerances
        from ..stack.fingerprint import collect

        fingerprint = collect(self.platform.device_kind)
        record = metrics_record(name, platform_key=platform, fingerprint=fingerprint, loss=loss, grad_norm=grad_norm,
                                clipped_grad_norm=clipped_grad_norm, param_grad_norms=param_grad_norms, tensors=tensors)
        limits = tolerances(rtol)
        if replicas and self.places.recording(name, platform):
            reruns = [metrics_record(name, platform_key=platform, fingerprint=fingerprint, **dict(r)) for r in replicas]
            record.arrays.update(envelope.measure(record, reruns))
        policy = replace(self.policy, lane="tolerant") if limits is not None else self.policy
        return self.pipeline.check(record, name, Comparator(policy, tolerances=limits), [])

    # --- the built-in suite's one test -------------------------------------------------------------

    def run_case(self, scenario: str, case_id: str) -> None:
        """Run one case of a registered scenario and judge it: its launch (or experiment), then its own checks, and
        its reference where it has one, explained by triage where it fails."""
        __tracebackhide__ = True
        sc, case = self.selection.runnable_case(scenario, case_id)
        comparator = comparator_of(sc, case, self.setup, self.policy)
        reference = sc.reference_name(case)
        if reference is not None and sc.kind == "training":
            self._watch_case(sc, case, reference, comparator)
        ran: list[RunRecord] = []  # the launches an experiment ran, to count their faults' firings
        record = self._launched(sc, case, reference, ran)
        lacking = sc.unsupported(case, record, self.setup)
        if lacking:  # never judged: nothing was computed, so nothing is wrong (the scenario's summary counts these)
            raise NotSupported(lacking)
        # A fault that never fired proves nothing; judged per launch (or per experiment), as counted.
        unfired = self._faults_unfired([r.results for r in ran or [record]])
        self.figures.update(sc.properties(case, record, self.setup))
        if reference is None:
            self._check_alone(sc, case, record, comparator, unfired)
            return
        self._before_judging(sc, case, record, recorded=self.places.recording(reference, record.platform_key)
                             and not unfired and not comparator.own_checks(record))
        self.pipeline.check(record, reference, comparator, unfired, self._explainer(sc, case),
                            kept_as=test_id(sc, case))

    def _check_alone(self, sc: Scenario, case: Case, record: RunRecord, comparator: Comparator,
                     unfired: list[str]) -> None:
        """Judge a case that reads no reference (a check case, an experiment) on its own checks."""
        __tracebackhide__ = True
        if not record.platform_key:  # an experiment's own record (triage's): kept under this run's platform
            record.platform_key = self.platform.key(sc.platform_tag(sc.default_config(self.setup)))
        self.pipeline.check_without_reference(record, test_id(sc, case), comparator, unfired,
                                              judged=lambda passed: self._tally(sc, case, passed))

    @property
    def _fails_fast(self) -> bool:
        """--gpuregress-fail-fast, which a recording run ignores."""
        return self.options.fail_fast and not self.options.record

    def _before_judging(self, sc: Scenario, case: Case, record: RunRecord, recorded: bool) -> None:
        """A record about to be ``recorded`` gets what its reference keeps beside the run: its noise envelope,
        step 0's distance from a float64 oracle where one is at hand, and the scenario's attachments (a resume
        checkpoint). A bf16 run to compare is held to its reference's precision: its distance is measured too."""
        if not recorded:
            if oracle_distance.judges_precision(record):
                measure_oracle_distance(sc, self.setup, self.launches.cached, record, case.data.get("model"))
            return
        if self.options.replicas:
            self.launches.add_envelope(sc, self.selection.launch_of(sc, case), record, [])
        measure_oracle_distance(sc, self.setup, self.launches.cached, record, case.data.get("model"))
        record.attachments.update(sc.attachments(case, record, self.launches.cached, self.setup))

    def _launched(self, sc: Scenario, case: Case, reference: str | None, ran: list[RunRecord]) -> RunRecord:
        """The case's record: from its experiment, from its stored reference (a resume), or its launch. A rank that
        failed is a row in the closing table too; one whose backend lacks an op the run needs is not supported."""
        __tracebackhide__ = True
        try:
            return sc.experiment(case, keeping(self.launches.cached, ran), self.setup) \
                or self._from_reference(sc, case, reference, keeping(self.launches.cached, ran)) \
                or self.launches.for_case(sc, case)
        except RankFailure as exc:
            unsupported = self._failed(sc, case, reference, exc)
            if unsupported is not None:
                raise unsupported from None
            raise

    def _failed(self, sc: Scenario, case: Case, reference: str | None, exc: RankFailure) -> NotSupported | None:
        """A failed launch's row in the closing table; the skip to raise instead where the stack lacks an op the run
        needs (a capability, not a wrong number)."""
        key = self._key_alone(sc, case)
        lacks = NotSupported.backend_lacks(exc) or NotSupported.kernel_path_lacks(exc)
        if lacks:
            add_outcome(self.outcomes, Outcome(reference or sc.name, key, "not supported", detail=lacks))
            return self._lacking(sc, reference, key, lacks, exc)
        self._tally(sc, case, passed=False)  # a sweep that crashed passed nothing
        add_outcome(self.outcomes, Outcome(reference or sc.name, key, "error", detail=str(exc).splitlines()[0]))
        return None

    def _key_alone(self, sc: Scenario, case: Case) -> str:
        """The platform key of ``case``'s launch planned for it alone, else of the scenario's default config."""
        launch = next((la for la in sc.launches([case], self.setup) if la.key == case.launch), None)
        return self.platform.key(sc.platform_tag(launch.config if launch else sc.default_config(self.setup)))

    def _lacking(self, sc: Scenario, reference: str | None, key: str, lacks: str, exc: RankFailure) -> NotSupported:
        """The skip for a stack that lacks an op the case needs, saying whether its reference's stack ran it."""
        import torch

        compared = reference is not None and not self.places.recording(reference, key)
        also = ", which the reference's stack ran" if compared else ""
        forced = os.environ.get("ATEN_CPU_CAPABILITY")
        path = f", ATEN_CPU_CAPABILITY={forced}" if forced and NotSupported.kernel_path_lacks(exc) else ""
        return NotSupported(f"this stack ({self.platform.backend}, torch {torch.__version__}{path}) lacks an op "
                            f"{reference or sc.name} needs{also}: {lacks}")

    def _explainer(self, sc: Scenario, case: Case) -> Explain:
        """What explains a failed comparison of ``case``: triage's experiments, the session's check scenarios and
        the run's own evidence, the bisect where asked for."""
        bisect = BisectRequest(self.output_dir, self.options.wheelhouse) if self.options.bisect else None

        def explain(ref: RunRecord, comparison: Comparison, whole: RunRecord, failed: RunRecord) -> Explanation:
            return explain_failure(sc, self.setup, self.launches.cached, ref, comparison, case.data.get("model"),
                                   self.options.triage, run_experiments=sc.triage_explains(case), case=case,
                                   checks=[*self._checks_evidence(), *own_evidence(failed)], whole_reference=whole,
                                   bisect=bisect)
        return explain

    def _tally(self, sc: Scenario, case: Case, passed: bool) -> None:
        """Count a check case whose results speak on other scenarios' failures (Scenario.evidence_for)."""
        if sc.evidence_for:
            passes, failures = self.checked.setdefault(sc.evidence_name, (0, []))
            self.checked[sc.evidence_name] = (passes + passed, failures + ([] if passed else [test_id(sc, case)]))

    def _checks_evidence(self) -> list[Any]:
        return [session_checks(name, passes, failures) for name, (passes, failures) in self.checked.items()]

    def _from_reference(self, sc: Scenario, case: Case, name: str | None, run: Runner) -> RunRecord | None:
        """The run of a case that starts from its stored reference (Scenario.from_reference); None when recording
        it, and for every other case."""
        if name is None:
            return None
        key = self.platform.key(sc.platform_tag(self.selection.launch_of(sc, case).config))
        if self.places.recording(name, key):
            return None
        loc = self.places.location(name, key)
        try:
            return sc.from_reference(case, lambda: store.read_reference(loc), run, self.setup)
        except ReferenceProblem as exc:  # missing or corrupt: a row in the closing table too
            self.pipeline.unusable(exc, name, key, loc)
            raise

    def _faults_unfired(self, results: list[dict[str, Any]]) -> list[str]:
        """Failures for injected faults that fired zero times in ``results``; the counts go to JUnit."""
        fired = firing.totals(results)
        if fired:
            self.figures["faults_fired"] = [f"{spec}: {count}" for spec, count in fired.items()]
        return firing.unfired(results)

    def _watch_case(self, sc: Scenario, case: Case, reference: str, comparator: Comparator) -> None:
        """For --gpuregress-fail-fast: hand a training case's launch its reference, unless it already ran."""
        if self._fails_fast and not self.launches.started(sc, case):
            self._watch(sc, self.selection.launch_of(sc, case), reference, comparator)

    def _watch(self, sc: Scenario, launch: Launch, name: str, comparator: Comparator) -> None:
        """For --gpuregress-fail-fast: hand the launch its reference, to stop at the first miss."""
        try:
            reference = store.read_reference(self.places.location(name, self.platform.key(sc.platform_tag(launch.config))))
        except GpuRegressError:  # missing or unreadable: the comparison after the run says so
            reference = None
        self.launches.watches[(sc.name, launch.key)] = comparator.watch(reference)
