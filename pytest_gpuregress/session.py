"""One pytest session's gpuregress state: platform, launcher, reference store, results.

The plugin creates it when ``--gpuregress`` is on; the ``gpuregress`` fixture hands it to tests.
It ties a scenario run (launch) to a reference (store) and a verdict (compare, report).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import store
from .compare import Comparison, compare_training
from .errors import MissingReference
from .launch.job import Job
from .options import Options
from .paths import data_dir
from .platforms import Platform, resolve_platform
from .record import RunRecord
from .report import format_comparison
from .scenarios import FunctionScenario, Scenario, get_scenario
from .sweep import CollectiveSweep, protocol_groups


class RegressionFailure(AssertionError):
    """A run differs from its reference. The message is the full report."""


@dataclass
class Outcome:
    """One scenario run, for the terminal summary."""

    scenario: str
    platform_key: str
    verdict: str  # passed | failed | recorded | error
    lane: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)


class GpuRegressSession:
    def __init__(self, options: Options, rootpath: Path, output_dir: Path | None = None) -> None:
        self.options = options
        self.rootpath = rootpath
        self.output_dir = output_dir
        self.platform: Platform = resolve_platform(options.device, options.world_size)
        self.outcomes: list[Outcome] = []
        self._launcher: Any = None
        groups = protocol_groups(options.nccl_protos, options.nccl_algos, self.platform.backend)
        self.collectives = CollectiveSweep(self, groups)

    @property
    def protocol_pinning_ignored(self) -> bool:
        """Protocol options were given but this backend has no protocols to pin."""
        return bool(self.options.nccl_protos or self.options.nccl_algos) and self.platform.backend != "nccl"

    # --- where references live ------------------------------------------------------------------

    @property
    def user_reference_root(self) -> Path:
        return self.options.reference_dir or (self.rootpath / "reference_runs")

    @property
    def shipped_reference_root(self) -> Path:
        return data_dir("reference_runs")

    def record_hint(self, scenario: str) -> str:
        parts = ["pytest", "--gpuregress", "--gpuregress-record", "-k", scenario]
        parts.append(f"--gpuregress-reference-dir={self.user_reference_root}")
        if self.options.steps:
            parts.append(f"--gpuregress-steps={self.options.steps}")
        if self.options.world_size:
            parts.append(f"--gpuregress-world-size={self.options.world_size}")
        if self.options.device != "auto":
            parts.append(f"--gpuregress-device={self.options.device}")
        return shlex.join(parts)

    def location(self, scenario: str, platform_key: str, *, for_writing: bool = False) -> store.ReferenceLocation:
        hint = self.record_hint(scenario)
        user = store.ReferenceLocation(self.user_reference_root, scenario, platform_key, hint)
        # An explicit --gpuregress-reference-dir means that directory only; the shipped
        # references are the fallback of the default location.
        if for_writing or self.options.reference_dir is not None or (user.path / store.MANIFEST).exists():
            return user
        shipped = store.ReferenceLocation(self.shipped_reference_root, scenario, platform_key, hint)
        if (shipped.path / store.MANIFEST).exists():
            return shipped
        return user

    # --- running ----------------------------------------------------------------------------------

    @property
    def launcher(self) -> Any:
        if self._launcher is None:
            if self.platform.in_place:
                from .launch.inplace import InPlaceLauncher

                self._launcher = InPlaceLauncher()
            else:
                from .launch.spawn import SpawnLauncher

                self._launcher = SpawnLauncher(keep_dirs=self.options.keep_runs, base_dir=self.output_dir)
        return self._launcher

    def resolve(self, scenario: str | Scenario) -> Scenario:
        return get_scenario(scenario) if isinstance(scenario, str) else scenario

    def run(
        self,
        scenario: str | Scenario,
        *,
        config: dict[str, Any] | None = None,
        faults: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> RunRecord:
        """Run ``scenario`` on every rank and return the merged record."""
        sc = self.resolve(scenario)
        cfg = sc.default_config(self.platform.device_kind, self.options.steps)
        cfg.update(config or {})
        entry = sc.entry if isinstance(sc, FunctionScenario) else sc.name
        job = Job(
            scenario=entry,
            config=cfg,
            world_size=self.platform.world_size,
            device_kind=self.platform.device_kind,
            backend=self.platform.backend,
            run_dir=str(self.launcher.make_run_dir()),
            # The wall-clock limit fires first, so hung ranks are reported with their stacks
            # rather than a peer's collective timeout.
            timeout_s=self.options.timeout + 60,
            faults=[*self.options.inject, *(faults or [])],
            env=dict(env or {}),
            loopback_only=not self.platform.in_place,
        )
        result = self.launcher.run(job, wall_timeout_s=self.options.timeout)
        record = sc.merge(result.records)
        record.platform_key = self.platform.key(sc.platform_tag(cfg))
        record.timings["launch_wall_s"] = result.wall_s
        listening = {}
        for rec in result.records:
            listening.update(rec.results.get("listening", {}))
        if listening:
            record.results["listening"] = listening
        record.notes.extend(result.notes)
        return record

    # --- verdicts -----------------------------------------------------------------------------------

    def check_collective(self, case_id: str) -> None:
        """Fail with the op, dtype, size, placement, first wrong index, rank and values when wrong."""
        __tracebackhide__ = True
        from .collectives import verdict

        case, result = self.collectives.result(case_id)
        problem = verdict(case, result, self.platform.world_size)
        if problem:
            raise RegressionFailure(f"[collective] {problem}")

    def check(self, record: RunRecord, *, name: str | None = None) -> Comparison | None:
        """Record ``record`` (with --gpuregress-record) or compare it with its reference.

        Raises RegressionFailure with the full report when it differs; MissingReference,
        CorruptReference or ForeignReference when the reference cannot be used.
        """
        __tracebackhide__ = True
        scenario = name or record.scenario
        if self.options.record:
            loc = self.location(scenario, record.platform_key, for_writing=True)
            if not getattr(self.launcher, "is_writer", True):  # under torchrun only rank 0 writes
                return None
            path = store.write_reference(loc, record, overwrite=True)
            self.outcomes.append(Outcome(scenario, record.platform_key, "recorded", detail=str(path),
                                         notes=record.notes))
            return None
        loc = self.location(scenario, record.platform_key)
        try:
            reference = store.read_reference(loc)
        except MissingReference:
            self.outcomes.append(Outcome(scenario, record.platform_key, "error", detail="no reference"))
            raise
        store.check_compatible(loc, reference, record)
        comparison = compare_training(reference, record, lane=self.options.lane)
        verdict = "passed" if comparison.passed else "failed"
        loss = record.series.get("loss") or [float("nan")]
        detail = f"{record.steps} steps, loss {loss[0]:.4f} -> {loss[-1]:.4f}, reference {loc.path}"
        if comparison.lane == "tolerant":
            detail += f"; {comparison.lane_reason}"
        self.outcomes.append(Outcome(scenario, record.platform_key, verdict, comparison.lane, detail, record.notes))
        if not comparison.passed:
            raise RegressionFailure(
                format_comparison(
                    comparison,
                    scenario=scenario,
                    platform_key=record.platform_key,
                    reference_path=str(loc.path),
                    record_hint=loc.record_hint,
                )
            )
        return comparison
