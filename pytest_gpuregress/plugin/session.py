"""One pytest session's gpuregress state: platform, launcher, references, launches and results.

The plugin creates it when ``--gpuregress`` is on; the ``gpuregress`` fixture hands it to tests.
It ties a scenario (launch) to a reference (store) and a verdict (compare, report), through the
scenario interface only: nothing here names a scenario.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    GpuRegressError,
    MissingReference,
    NotApplicable,
    RankFailure,
    ReferenceProblem,
    RegressionFailure,
)
from ..faults import check_ranks, firing, reach
from ..launch.job import Job
from ..reference import envelope, failfast, kernels, perf, store
from ..reference.compare import Comparison, compare_training, tolerant_limits
from ..reference.names import safe_component
from ..reference.plot import first_divergence
from ..reference.record import RunRecord
from ..reference.report import format_comparison, format_margins
from ..resources import shipped_dir
from ..scenarios import Case, Launch, Scenario, Setup, get_scenario, registry
from ..stack.fingerprint import describe_change
from ..stack.platforms import SINGLE_RANK_GAPS, Platform, rank_origin, resolve_platform, too_few_ranks
from ..warn import warn_at_test
from .artifacts import Artifacts, compare_command
from .observations import Observations
from .options import Options


@dataclass
class Outcome:
    """One scenario run, for the terminal summary."""

    scenario: str
    platform_key: str
    verdict: str  # passed | failed | recorded | error
    lane: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    worst: float | None = None  # the largest deviation as a multiple of its tolerant-lane limit
    seconds: float | None = None
    reproduce: str = ""  # the command that reproduces the verdict: record on a missing reference, compare on a failure


def test_id(scenario: Scenario, case: Case) -> str:
    """The case's pytest id: the scenario's name, then the case's own id where it has one."""
    return reach.test_id(scenario.name, case.id)


class GpuRegressSession:
    def __init__(self, options: Options, rootpath: Path, output_dir: Path | None = None) -> None:
        self.options = options
        self.rootpath = rootpath
        # Failed runs, plots, rank logs and check scenarios' records go here (named in the header).
        self.output_dir = options.artifacts or output_dir or Path(tempfile.mkdtemp(prefix="gpuregress-artifacts-"))
        self.artifacts = Artifacts(self.output_dir)
        self.figures: dict[str, Any] = {}  # the current test's key figures, for JUnit properties and HTML extras
        self.platform: Platform = resolve_platform(options.device, options.world_size)
        check_ranks(options.faults, self.platform.world_size, rank_origin(self.platform, options.world_size))
        self.setup = Setup(
            device_kind=self.platform.device_kind,
            backend=self.platform.backend,
            world_size=self.platform.world_size,
            steps=options.steps,
            faults=options.faults,
            options=dict(options.scenario_values),
            tokens=options.tokens,
            models=options.models,
        )
        self.outcomes: list[Outcome] = []
        self.selected: dict[str, list[Case]] = {}  # scenario -> cases left after -k and -m
        # scenario -> launch key -> merged record, or the launch's failure message
        self.launched: dict[str, dict[str, RunRecord | RankFailure]] = {}
        self.known_issues: list[Any] = []  # stack/known_issues.py: set at configure time, matched in the header
        self.watches: dict[tuple[str, str], dict[str, Any]] = {}  # (scenario, launch) -> fail-fast reference
        self.uncapture: Callable[[], None] = lambda: None  # the plugin stops pytest's output capture with it
        self.progress: Callable[[str], None] | None = None  # where ranks' progress goes while they run (plugin)
        self.saved: dict[tuple[str, str], Path] = {}
        self._recorded: dict[Path, RunRecord] = {}
        self._launcher: Any = None

    # --- cases ---------------------------------------------------------------------------------

    def all_cases(self) -> list[tuple[Scenario, Case]]:
        return [(sc, case) for sc in registry().values() for case in sc.cases(self.setup)]

    def select(self, chosen: set[tuple[str, str]]) -> None:
        """Keep the (scenario, case id) pairs that survived -k and -m, so launches carry only those."""
        self.selected = {}
        for sc, case in self.all_cases():
            if (sc.name, case.id) in chosen and self.rank_shortfall(case) is None:  # skipped ones launch nothing
                self.selected.setdefault(sc.name, []).append(case)

    def rank_shortfall(self, case: Case) -> str | None:
        """Why ``case`` cannot run with this run's ranks (the skip reason), or None when it can."""
        return too_few_ranks(case.min_ranks, self.platform, self.options.world_size)

    def rank_header(self) -> list[str]:
        """At one rank, the header says what it cannot exercise, and how many cases are skipped for it."""
        if self.platform.world_size > 1:
            return []
        skipped = sum(self.rank_shortfall(case) is not None for _, case in self.all_cases())
        return [f"gpuregress single rank ({rank_origin(self.platform, self.options.world_size)}): {SINGLE_RANK_GAPS}; "
                f"{skipped} cases that need 2 or more ranks are skipped, and faults that need peers are refused"]

    # --- where references live ------------------------------------------------------------------

    @property
    def user_reference_root(self) -> Path:
        return self.options.reference_dir or (self.rootpath / "reference_runs")

    @property
    def shipped_reference_root(self) -> Path:
        return shipped_dir("reference_runs")

    def record_hint(self, selection: str) -> str:
        parts = ["pytest", "--gpuregress", "--gpuregress-record", "-k", selection]
        parts.append(f"--gpuregress-reference-dir={self.user_reference_root}")
        if self.options.steps:
            parts.append(f"--gpuregress-steps={self.options.steps}")
        if self.options.world_size:
            parts.append(f"--gpuregress-world-size={self.options.world_size}")
        if self.options.device != "auto":
            parts.append(f"--gpuregress-device={self.options.device}")
        # The models and data shape the config too (a model's cases exist only with its option).
        parts += [f"--gpuregress-model={m.name if m.shipped else m.source}" for m in self.options.models]
        if self.options.tokens is not None:
            parts.append(f"--gpuregress-tokens={self.options.tokens}")
        # A scenario's own options can shape its config: the hinted command must record the same setup.
        specs = {spec.dest: spec for sc in registry().values() for spec in sc.options}
        for dest, value in sorted(self.options.scenario_values.items()):
            spec = specs.get(dest)
            if spec is not None and value != spec.default:
                shown = ",".join(value) if isinstance(value, list) else value
                parts.append(f"{spec.flag}={shown}")
        return shlex.join(parts)

    def _selection_of(self, name: str) -> str:
        """A -k expression that selects the cases stored under reference ``name``: the name itself when it is a
        substring of each of their ids (fsdp, lora), else their ids joined (lora-mymoe: lora-fully_shard-mymoe ...)."""
        ids = [test_id(sc, case) for sc, case in self.all_cases() if sc.reference_name(case) == name]
        return name if not ids or all(name in i for i in ids) else " or ".join(ids)

    def location(self, name: str, platform_key: str, *, for_writing: bool = False) -> store.ReferenceLocation:
        store.check_names(name, platform_key)  # a name or dtype such as '../x' must not leave the reference dir
        hint = self.record_hint(self._selection_of(name))
        user = store.ReferenceLocation(self.user_reference_root, name, platform_key, hint)
        # An explicit --gpuregress-reference-dir means that directory only; the shipped
        # references are the fallback of the default location.
        if for_writing or self.options.reference_dir is not None or (user.path / store.MANIFEST).exists():
            return user
        shipped = store.ReferenceLocation(self.shipped_reference_root, name, platform_key, hint)
        if (shipped.path / store.MANIFEST).exists():
            return shipped
        return user

    # --- running ----------------------------------------------------------------------------------

    @property
    def launcher(self) -> Any:
        if self._launcher is None:
            if self.platform.in_place:
                from ..launch.inplace import InPlaceLauncher

                self._launcher = InPlaceLauncher(self.uncapture)
            else:
                from ..launch.spawn import SpawnLauncher

                self._launcher = SpawnLauncher(keep_dirs=self.options.keep_runs, base_dir=self.output_dir,
                                               reuse=not self.options.fresh_ranks)
                self._launcher.on_progress = self.progress
        return self._launcher

    def close(self) -> None:
        """Stop pooled rank processes; called once at the end of the pytest session."""
        if self._launcher is not None and hasattr(self._launcher, "close"):
            self._launcher.close()

    def run(
        self,
        scenario: str | Scenario,
        *,
        config: dict[str, Any] | None = None,
        faults: list[str] | None = None,
        env: dict[str, str] | None = None,
        reference: str | None = None,
    ) -> RunRecord:
        """Run ``scenario`` (a name, "module:function", or a Scenario) on every rank; return the merged record.

        ``reference``: the name ``check`` will compare the record with. Given it, the run works as the built-in
        scenarios do: --gpuregress-fail-fast hands the ranks the reference to stop at the first miss, and
        --gpuregress-record also runs the noise replicas whose spread is stored as the envelope."""
        sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
        cfg = sc.default_config(self.setup)
        cfg.update(config or {})
        launch = Launch("default", cfg, dict(env or {}))
        self.watches.pop((sc.name, launch.key), None)  # an earlier run's reference is not this one's
        if reference is not None and self.options.fail_fast and not self.options.record:
            self._watch(sc, launch, reference)
        record = self._launch(sc, launch, faults or [])
        if reference is not None and self.recording(reference, record.platform_key) and self.options.replicas:
            self._add_envelope(sc, launch, record, faults or [])
        return record

    def _launch(self, sc: Scenario, launch: Launch, faults: list[str]) -> RunRecord:
        if self.platform.in_place and (launch.env or launch.fresh_ranks
                                       or launch.world_size not in (None, self.platform.world_size)):
            # Under torchrun every process already is one rank of one group with one environment.
            raise NotApplicable(f"launch {launch.key!r} of {sc.name!r} needs its own group of ranks "
                                f"({launch.world_size or self.platform.world_size} ranks, environment {launch.env or 'as is'}), "
                                "which cannot be started in place under torchrun; run it spawned locally")
        job = Job(
            scenario=launch.entry or sc.rank_entry,
            config=launch.config,
            world_size=launch.world_size or self.platform.world_size,
            device_kind=self.platform.device_kind,
            backend=self.platform.backend,
            run_dir=str(self.launcher.make_run_dir()),
            # The wall-clock limit fires first, so hung ranks are reported with their stacks
            # rather than a peer's collective timeout.
            timeout_s=self.options.timeout + 60,
            faults=[*(self._injected(sc, launch) if launch.inject else ()), *faults],
            env=dict(launch.env),
            loopback_only=not self.platform.in_place,
            watch=self.watches.get((sc.name, launch.key), {}),
            fresh_ranks=launch.fresh_ranks,
            profile=self.options.kernel_changes != "off",
        )
        result = self.launcher.run(job, wall_timeout_s=self.options.timeout)
        record = sc.merge(result.records)
        record.platform_key = self.platform.key(sc.platform_tag(launch.config))
        record.timings["launch_wall_s"] = result.wall_s
        listening: dict[str, Any] = {}
        for rec in result.records:
            listening.update(rec.results.get("listening", {}))
        if listening:
            record.results["listening"] = listening
        if job.faults:
            _count_faults(record, job.faults, result.records)
        record.notes.extend(result.notes)
        return record

    def _injected(self, sc: Scenario, launch: Launch) -> list[str]:
        """The --gpuregress-inject specs that act in a case this launch serves (faults/reach.py)."""
        served = [c.id for c in self.selected.get(sc.name, []) if c.launch == launch.key]
        return reach.reaching(self.options.inject, sc.name, served, self.platform.device_kind)

    def launch_cached(self, sc: Scenario, launch: Launch) -> RunRecord:
        """Run ``launch`` of ``sc`` once per session, however many cases or experiments ask for it.

        A failed launch fails every later request with the same message, without running again."""
        done = self.launched.setdefault(sc.name, {})
        if launch.key not in done:
            try:
                done[launch.key] = self._launch(sc, launch, [])
            except RankFailure as exc:
                done[launch.key] = RankFailure(f"scenario {sc.name!r}, launch {launch.key!r} did not finish:\n{exc}")
            else:
                self._save_artifacts(sc, launch.key, self._served(sc.name, launch.key))
        return self._served(sc.name, launch.key)

    def launch_for(self, sc: Scenario, case: Case) -> RunRecord:
        """The merged record of the launch that carries ``case``: run on first use, then served from the cache."""
        if case.launch in self.launched.get(sc.name, {}):  # planning the launch again would cost a sweep dearly
            return self._served(sc.name, case.launch)
        return self.launch_cached(sc, self._launch_of(sc, case))

    def _served(self, scenario: str, key: str) -> RunRecord:
        outcome = self.launched[scenario][key]
        if isinstance(outcome, RankFailure):
            raise outcome
        return outcome

    def _launch_of(self, sc: Scenario, case: Case) -> Launch:
        cases = self.selected.get(sc.name) or [case]
        return next(la for la in sc.launches(cases, self.setup) if la.key == case.launch)

    def _add_envelope(self, sc: Scenario, launch: Launch, record: RunRecord, faults: list[str]) -> None:
        """Run the noise replicas of ``launch`` and store their spread with ``record`` (record mode only)."""
        replicas = sc.noise_replicas(launch, self.setup, self.options.replicas)
        if self.platform.in_place:  # under torchrun a replica cannot bring an environment of its own
            replicas = [r for r in replicas if not r.env and r.world_size in (None, self.platform.world_size)]
        if not replicas or any(k.startswith(envelope.PREFIX) for k in record.arrays):
            return
        perturbed = [self._launch(sc, replica, faults) for replica in replicas]
        for replica, run in zip(replicas, perturbed):  # a user's loop that applied none of its perturbation
            missed = run.results.get("perturbation_not_applied")
            if missed:
                record.notes.append(f"noise replica {replica.key}: the loop did not apply {', '.join(missed)}, so it "
                                    "adds no spread; give Recorder the model (model=) and pass batches through "
                                    "rec.batch()")
        record.arrays.update(envelope.measure(record, perturbed))
        record.results["envelope"] = {"replicas": [r.key for r in replicas], "k": envelope.K,
                                      "floors": vars(envelope.floors_for(str(record.config.get("dtype", "fp32"))))}

    def _save_artifacts(self, sc: Scenario, key: str, record: RunRecord) -> None:
        if self.output_dir is None or sc.kind != "check":
            return
        for part, what in ((sc.name, "scenario name"), (record.platform_key, "platform key"), (key, f"launch key of {sc.name!r}")):
            safe_component(part, what)
        target = self.output_dir / sc.name / record.platform_key / key.replace("+", "_")
        record.save(target)
        for name, text in sc.artifacts(key, record, self.setup).items():
            (target / safe_component(name, f"artifact name of {sc.name!r}")).write_text(text)
        self.saved[(sc.name, key)] = target

    def triage(self, sc: Scenario, reference: RunRecord, comparison: Comparison,
               model: str | None = None) -> tuple[str | None, list[str]]:
        """The component behind a failed comparison, from experiments: equivalence and the oracle always,
        switches flipped with --gpuregress-triage."""
        from .. import triage
        from ..reference import model_layout
        from ..triage.flips import flip

        model_changed = any(f.component == model_layout.COMPONENT for f in comparison.findings)
        try:
            # Equivalence and the oracle need no reference: even where the model's code changed, they can
            # still convict a collective or a kernel of this stack, which re-recording must not bury.
            experiments = triage.cheap_evidence(sc, self.setup, self.launch_cached, model)
            if model_changed and not any(e.convicts for e in experiments):
                return model_layout.COMPONENT, ["", "triage verdict: model. Evidence: the model's parameter layout "
                                                "differs from the reference's, so the runs start from other weights; "
                                                "equivalence and the oracle on this stack convict nothing",
                                                *triage.report("", experiments)[2:]]
            if self.options.triage and not model_changed:  # flips compare with a reference that cannot judge
                experiments += flip(sc, self.setup, self.launch_cached, reference, comparison, model)
        except Exception as exc:  # noqa: BLE001 - triage must never hide the regression it explains
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            return None, ["", f"triage could not run ({type(exc).__name__}: {first}); components are the heuristic's"]
        component, line = triage.verdict(comparison, experiments)
        return component, triage.report(line, experiments)

    # --- verdicts -----------------------------------------------------------------------------------

    def run_case(self, scenario: str, case_id: str) -> None:
        """Run one case of a registered scenario and give its verdict: the built-in suite's one test."""
        __tracebackhide__ = True
        sc = registry()[scenario]
        # Cases skipped for want of ranks are not in ``selected``: look them up among all the scenario's cases.
        case = next((c for c in self.selected.get(scenario, []) if c.id == case_id), None) \
            or next(c for c in sc.cases(self.setup) if c.id == case_id)
        shortfall = self.rank_shortfall(case)
        if shortfall:  # a direct call; the built-in suite already skips such cases
            raise NotApplicable(shortfall)
        unreached = reach.unreached_reason(self.options.inject, sc.name, case.id, self.platform.device_kind)
        if unreached:  # it would run clean, proving nothing about the faults asked for
            raise NotApplicable(unreached)
        if self.options.fail_fast and not self.options.record:
            self._watch_reference(sc, case)
        ran: list[RunRecord] = []  # the launches an experiment ran, to count their faults' firings
        try:
            record = sc.experiment(case, _keeping(self.launch_cached, ran), self.setup) or self.launch_for(sc, case)
        except RankFailure as exc:  # a row in the closing table too, not only a failed test
            launch = next((la for la in sc.launches([case], self.setup) if la.key == case.launch), None)
            key = self.platform.key(sc.platform_tag(launch.config if launch else sc.default_config(self.setup)))
            self._add_outcome(Outcome(sc.reference_name(case) or sc.name, key, "error", detail=str(exc).splitlines()[0]))
            raise
        # A fault that never fired proves nothing; judged per launch (or per experiment), as counted.
        problems = self._faults_unfired([r.results for r in ran or [record]])
        problems += sc.verdict(case, record, self.setup)
        if sc.kind == "training":  # floating-point work on the host during a GPU run: a missing kernel
            problems += kernels.host_op_problems(record)
        self.figures.update(sc.properties(case, record, self.setup))
        reference = sc.reference_name(case)
        if reference is not None and self.recording(reference, record.platform_key) and self.options.replicas \
                and not problems:
            self._add_envelope(sc, self._launch_of(sc, case), record, [])
        if reference is not None:
            lane = self.options.lane
            self.check(record, name=reference, extra=problems, compare=lambda ref, run: sc.compare(ref, run, case, lane),
                       explain=(lambda ref, cmp: self.triage(sc, ref, cmp, case.data.get("model")))
                       if sc.supports_triage else None)
        elif problems:
            raise RegressionFailure("\n".join(problems))

    def _faults_unfired(self, results: list[dict[str, Any]]) -> list[str]:
        """Failures for injected faults that fired zero times in ``results``; the counts go to JUnit."""
        fired = firing.totals(results)
        if fired:
            self.figures["faults_fired"] = [f"{spec}: {count}" for spec, count in fired.items()]
        return firing.unfired(results)

    def _add_outcome(self, outcome: Outcome) -> None:
        if outcome not in self.outcomes:  # cases of one launch (or one reference): one summary line
            self.outcomes.append(outcome)

    def _watch_reference(self, sc: Scenario, case: Case) -> None:
        """For --gpuregress-fail-fast: hand the case's launch its reference, to stop at the first miss."""
        name = sc.reference_name(case)
        if sc.kind != "training" or name is None or case.launch in self.launched.get(sc.name, {}):
            return
        self._watch(sc, self._launch_of(sc, case), name)

    def _watch(self, sc: Scenario, launch: Launch, name: str) -> None:
        try:
            reference = store.read_reference(self.location(name, self.platform.key(sc.platform_tag(launch.config))))
        except GpuRegressError:  # missing or unreadable: the comparison after the run says so
            self.watches[(sc.name, launch.key)] = failfast.watch_from(None, {})
            return
        self.watches[(sc.name, launch.key)] = failfast.watch_from(reference, tolerant_limits(reference)[0])

    def recording(self, name: str, platform_key: str) -> bool:
        """Whether this run writes the reference ``name``: --gpuregress-record, or --gpuregress-record-missing and
        no reference exists where this run would read it."""
        if self.options.record:
            return True
        if not self.options.record_missing:
            return False
        return not (self.location(name, platform_key).path / store.MANIFEST).exists()

    def check(
        self,
        record: RunRecord,
        *,
        name: str | None = None,
        extra: list[str] | None = None,
        compare: Callable[[RunRecord, RunRecord], Comparison] | None = None,
        explain: Callable[[RunRecord, Comparison], tuple[str | None, list[str]]] | None = None,
    ) -> Comparison | None:
        """Record ``record`` (with --gpuregress-record) or compare it with its reference.

        ``extra``: reference-free findings of the scenario, reported with the comparison's.
        ``compare``: the scenario's own comparison (default: losses, gradients and weights).
        ``explain``: triage on a failure: (the component it convicts, report lines with the evidence).
        Raises RegressionFailure with the full report when it differs; MissingReference,
        CorruptReference or ForeignReference when the reference cannot be used.
        """
        __tracebackhide__ = True
        scenario = name or record.scenario
        extra = extra or []
        # For a user's own run (gpuregress.run); run_case has judged its case's faults already.
        extra = [*extra, *(p for p in self._faults_unfired([record.results]) if p not in extra)]
        if self.recording(scenario, record.platform_key):
            if extra:  # never store a reference that fails its own checks
                raise RegressionFailure(f"not recording {scenario!r}: the run fails its own checks\n" + "\n".join(extra))
            loc = self.location(scenario, record.platform_key, for_writing=True)
            if not getattr(self.launcher, "is_writer", True):  # under torchrun only rank 0 writes
                return None
            if self._recorded.get(loc.path) is record:  # cases of one launch sharing one reference
                return None
            path = store.write_reference(loc, record, overwrite=True)
            self._recorded[loc.path] = record
            self.outcomes.append(Outcome(scenario, record.platform_key, "recorded", detail=str(path),
                                         notes=record.notes))
            return None
        loc = self.location(scenario, record.platform_key)
        try:
            reference = store.read_reference(loc)
            store.check_compatible(loc, reference, record)
        except ReferenceProblem as exc:  # missing, corrupt or foreign: a row in the closing table too
            detail = "no reference" if isinstance(exc, MissingReference) else type(exc).__name__
            self._add_outcome(Outcome(scenario, record.platform_key, "error", detail=detail,
                                      reproduce=loc.record_hint))
            raise
        stop = record.results.get("fail_fast")
        if stop:  # the run ended early: compare the steps it ran, and say where and why it stopped
            reference = failfast.truncated_reference(reference, record.steps)
            extra = [failfast.describe(stop), *extra]
        comparison = (compare or (lambda ref, run: compare_training(ref, run, lane=self.options.lane)))(reference, record)
        observed = Observations.of(reference, record, self.options)
        comparison.kernel_changes = observed.kernel_changes
        extra = [*extra, *observed.failures()]
        passed = comparison.passed and not extra
        loss = record.series.get("loss")
        detail = f"{record.steps} steps, loss {loss[0]:.4f} -> {loss[-1]:.4f}, " if loss else ""
        detail += f"reference {loc.path}"
        if comparison.margins:
            detail += f"; {format_margins(comparison)}"
        if observed.detail():
            detail += f"; {observed.detail()}"
        if comparison.lane == "tolerant":
            detail += f"; {comparison.lane_reason}"
        kept = self.artifacts.keep(scenario, record, reference, comparison, keep_run=not passed or self.options.keep_runs,
                                   plot=not passed or self.options.plots)
        worst = max(comparison.margins.values(), default=None)
        outcome = Outcome(scenario, record.platform_key, "passed" if passed else "failed", comparison.lane, detail,
                          record.notes, worst, record.timings.get("launch_wall_s"),
                          compare_command(loc.path, kept.run) if kept.run and not passed else "")
        self._add_outcome(outcome)
        self.figures.update(lane=comparison.lane, platform_key=record.platform_key,
                            first_differing_step=first_divergence(comparison), worst_over_tolerance=worst,
                            seconds=outcome.seconds, plot=kept.plot,
                            stack_changes=[describe_change(*c) for c in comparison.stack_changes] or ["none"],
                            perf=perf.summary(observed.ratios) or None,
                            kernel_changes=None if observed.kernel_changes is None else len(observed.kernel_changes))
        # Warned once the outcome is kept: under -W error a warning raises, and must not lose the summary row.
        for category, message in observed.warnings():
            warn_at_test(category(f"{scenario} {record.platform_key}: {message}"))
        if comparison.passed and extra:
            raise RegressionFailure("\n".join([*extra, f"(the comparison with the reference {loc.path} passed)",
                                               *kept.report_lines(loc.path)]))
        if not passed:
            evidence: list[str] = []
            if explain is not None and comparison.findings:
                component, evidence = explain(reference, comparison)
                for finding in comparison.findings if component else ():  # experiments replace the heuristic's guess
                    finding.component = component
            report = format_comparison(comparison, scenario=scenario, platform_key=record.platform_key,
                                       reference_path=str(loc.path), record_hint=loc.record_hint) + "\n".join(evidence)
            if comparison.findings:  # a deviation: what the kernels did sits next to it
                report += "\n" + "\n".join(observed.evidence())
            report += "\n" + "\n".join(kept.report_lines(loc.path))
            raise RegressionFailure("\n".join([*extra, report]) if extra else report)
        return comparison


def _count_faults(record: RunRecord, texts: list[str], per_rank: list[RunRecord]) -> None:
    """Sum each fault's firings over the ranks of one launch into ``record``, with a note per fault."""
    counts = firing.by_rank(texts, [r.results.get(firing.RESULT_KEY, {}) for r in per_rank])
    record.results[firing.RESULT_KEY] = {spec: sum(ranks) for spec, ranks in counts.items()}
    record.notes.extend(firing.notes(texts, counts))


def _keeping(run: Callable[[Scenario, Launch], RunRecord], ran: list[RunRecord]) -> Callable[[Scenario, Launch], RunRecord]:
    """``run``, keeping each record it returns in ``ran``."""
    def keep(sc: Scenario, launch: Launch) -> RunRecord:
        ran.append(run(sc, launch))
        return ran[-1]
    return keep
