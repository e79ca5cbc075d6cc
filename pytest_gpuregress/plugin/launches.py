"""Groups of ranks: the launcher's lifecycle, one run per launch per session, noise replicas, and check
scenarios' records in the artifacts folder."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..comparison import envelope
from ..errors import NotApplicable, NotSupported, RankFailure
from ..faults import firing, reach
from ..launch import torch_trace
from ..launch.job import Job
from ..reference.names import safe_component
from ..reference.record import RunRecord
from ..scenarios import Case, Launch, Scenario, Setup
from ..scenarios.base import Runner
from ..stack.platforms import Platform
from .options import Options
from .selection import Selection


class Launches:
    def __init__(self, options: Options, platform: Platform, setup: Setup, selection: Selection, output_dir: Path) -> None:
        self.options = options
        self.platform = platform
        self.setup = setup
        self.selection = selection
        self.output_dir = output_dir
        self.launched: dict[str, dict[str, RunRecord | RankFailure]] = {}  # scenario -> launch key -> record or failure
        self.watches: dict[tuple[str, str], dict[str, Any]] = {}  # (scenario, launch) -> fail-fast reference
        self.saved: dict[tuple[str, str], Path] = {}  # (scenario, launch) -> a check scenario's record on disk
        self.uncapture: Callable[[], None] = lambda: None  # the plugin stops pytest's output capture with it
        self.progress: Callable[[str], None] | None = None  # where ranks' progress goes while they run (plugin)
        self._launcher: Any = None

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

    @property
    def writes_references(self) -> bool:
        return bool(getattr(self.launcher, "is_writer", True))  # under torchrun only rank 0 writes

    def close(self) -> None:
        """Stop pooled rank processes; called once at the end of the pytest session."""
        close = getattr(self._launcher, "close", None)  # none before the first launch, nor in place
        if close is not None:
            close()

    def launch(self, sc: Scenario, launch: Launch, faults: list[str]) -> RunRecord:
        """Run ``launch`` of ``sc`` on its ranks now; the merged record, with fault counts and the launch time."""
        if not self._runs_here(launch):
            raise NotApplicable(f"launch {launch.key!r} of {sc.name!r} needs its own group of ranks "
                                f"({launch.world_size or self.platform.world_size} ranks, environment {launch.env or 'as is'}), "
                                "which cannot be started in place under torchrun; run it spawned locally")
        job = self._job(sc, launch, faults)
        return self._merged(sc, launch, job, self.launcher.run(job, wall_timeout_s=self.options.timeout))

    def _merged(self, sc: Scenario, launch: Launch, job: Job, result: Any) -> RunRecord:
        """The ranks' records as one: with its platform key, the launch's time, what listened beyond loopback,
        the faults' firing counts and the launcher's notes."""
        record = sc.merge(result.records)
        record.platform_key = self.platform.key(sc.platform_tag(launch.config))
        record.timings["launch_wall_s"] = result.wall_s
        listening = {k: v for rec in result.records for k, v in rec.results.get("listening", {}).items()}
        if listening:
            record.results["listening"] = listening
        if job.faults:
            count_faults(record, job.faults, result.records)
        record.notes.extend(result.notes)
        return record

    def _runs_here(self, launch: Launch) -> bool:
        """Under torchrun every process already is one rank of one group with one environment: a launch that needs
        an environment of its own, fresh processes or another world size cannot run in place."""
        return not self.platform.in_place or not (
            launch.env or launch.fresh_ranks or launch.world_size not in (None, self.platform.world_size))

    def _job(self, sc: Scenario, launch: Launch, faults: list[str]) -> Job:
        """What the ranks of ``launch`` are handed: its config, the faults that reach its cases, the fail-fast
        reference, the timeout."""
        injected = reach.reaching(self.options.inject, self.selection.served_cases(sc, launch.key)) \
            if launch.inject else reach.installed_code(self.options.inject)
        return Job(
            scenario=launch.entry or sc.rank_entry,
            config=launch.config,
            world_size=launch.world_size or self.platform.world_size,
            device_kind=self.platform.device_kind,
            backend=self.platform.backend,
            run_dir=str(self.launcher.make_run_dir()),
            # gloo: the wall-clock limit fires first, so hung ranks are reported with their stacks rather than a
            # peer's collective timeout; NCCL/RCCL: torch's watchdog fires first and dumps its flight recorder.
            timeout_s=torch_trace.group_timeout(self.platform.backend, self.options.timeout),
            faults=[*injected, *faults],
            env=dict(launch.env),
            loopback_only=not self.platform.in_place,
            watch=self.watches.get((sc.name, launch.key), {}),
            fresh_ranks=launch.fresh_ranks or (launch.cold and not self.platform.in_place),
            profile=self.options.kernel_changes != "off",
        )

    def cached(self, sc: Scenario, launch: Launch) -> RunRecord:
        """Run ``launch`` of ``sc`` once per session, however many cases or experiments ask for it.

        A failed launch fails every later request with the same message, without running again."""
        done = self.launched.setdefault(sc.name, {})
        if launch.key not in done:
            try:
                done[launch.key] = self.launch(sc, launch, [])
            except RankFailure as exc:
                done[launch.key] = RankFailure(f"scenario {sc.name!r}, launch {launch.key!r} did not finish:\n{exc}")
            else:
                self._save_check_record(sc, launch.key, self.served(sc.name, launch.key))
        return self.served(sc.name, launch.key)

    def for_case(self, sc: Scenario, case: Case) -> RunRecord:
        """The merged record of the launch that carries ``case``: run on first use, then served from the cache."""
        if self.started(sc, case):  # planning the launch again would cost a sweep dearly
            return self.served(sc.name, case.launch)
        return self.cached(sc, self.selection.launch_of(sc, case))

    def served(self, scenario: str, key: str) -> RunRecord:
        outcome = self.launched[scenario][key]
        if isinstance(outcome, RankFailure):
            raise outcome
        return outcome

    def started(self, sc: Scenario, case: Case) -> bool:
        return case.launch in self.launched.get(sc.name, {})

    def add_envelope(self, sc: Scenario, launch: Launch, record: RunRecord, faults: list[str]) -> None:
        """Run the noise replicas of ``launch`` and store their spread with ``record`` (record mode only)."""
        replicas = [r for r in sc.noise_replicas(launch, self.setup, self.options.replicas) if self._runs_here(r)]
        if not replicas or any(k.startswith(envelope.PREFIX) for k in record.arrays):
            return
        ran = self._replicas_that_ran(sc, replicas, faults, record)
        # A replica whose loop (a user's) applied none of its perturbation adds no spread.
        record.notes.extend(f"noise replica {replica.key}: the loop did not apply {', '.join(missed)}, so it adds no "
                            "spread; give Recorder the model (model=) and pass batches through rec.batch()"
                            for replica, run in ran if (missed := run.results.get("perturbation_not_applied")))
        record.arrays.update(envelope.measure(record, [run for _, run in ran]))
        record.results["envelope"] = {"replicas": [replica.key for replica, _ in ran], "k": envelope.K,
                                      "floors": vars(envelope.floors_for(str(record.config.get("dtype", "fp32"))))}

    def _replicas_that_ran(self, sc: Scenario, replicas: list[Launch], faults: list[str],
                           record: RunRecord) -> list[tuple[Launch, RunRecord]]:
        """Each replica's run. One that only moves the kernel path (an environment of its own) may fail where this
        stack cannot run the case on the lower path at all (torch 2.13's bf16 attention on an AMX CPU forced to
        AVX2): that path is not this stack's, so the envelope comes from the others and the record says why."""
        kept: list[tuple[Launch, RunRecord]] = []
        for replica in replicas:
            try:
                kept.append((replica, self.launch(sc, replica, faults)))
            except RankFailure as exc:
                if not replica.env or not NotSupported.kernel_path_lacks(exc):
                    raise
                setting = ", ".join(f"{k}={v}" for k, v in replica.env.items())
                record.notes.append(f"noise replica {replica.key} left out: this stack cannot run the case with "
                                    f"{setting} ({_first_error(str(exc))}); the envelope is measured from the other "
                                    "replicas")
        return kept

    def _save_check_record(self, sc: Scenario, key: str, record: RunRecord) -> None:
        if sc.kind != "check":
            return
        for part, what in ((sc.name, "scenario name"), (record.platform_key, "platform key"), (key, f"launch key of {sc.name!r}")):
            safe_component(part, what)
        target = self.output_dir / sc.name / record.platform_key / key.replace("+", "_")
        record.save(target)
        for name, text in sc.artifacts(key, record, self.setup).items():
            (target / safe_component(name, f"artifact name of {sc.name!r}")).write_text(text)
        self.saved[(sc.name, key)] = target


def count_faults(record: RunRecord, texts: list[str], per_rank: list[RunRecord]) -> None:
    """Sum each fault's firings over the ranks of one launch into ``record``, with a note per fault."""
    counts = firing.by_rank(texts, [r.results.get(firing.RESULT_KEY, {}) for r in per_rank])
    record.results[firing.RESULT_KEY] = {spec: sum(ranks) for spec, ranks in counts.items()}
    record.notes.extend(firing.notes(texts, counts))


def keeping(run: Runner, ran: list[RunRecord]) -> Runner:
    """``run``, keeping each record it returns in ``ran``."""
    def keep(sc: Scenario, launch: Launch) -> RunRecord:
        ran.append(run(sc, launch))
        return ran[-1]
    return keep


def _first_error(text: str) -> str:
    """The last exception line of a rank's traceback ('RuntimeError: ...'), else the message's first line."""
    errors = [line.strip() for line in text.splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
    return errors[-1] if errors else text.strip().splitlines()[0]
