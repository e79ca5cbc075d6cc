"""Scenario ``checkpoint``: round trips, resharding, exact resume and cross-platform portability.

Cases full-state-dict, tied, sharded-<N>to<M>, resume and portability (docs/checkpoint.md); session side,
torch-free, every rank runs rank.py. Checkpoints live in temporary folders under ``--gpuregress-checkpoint-dir``,
removed once the case is done; faults that emulate the bug classes: faults/checkpoint.py.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...comparison.compare import ROUND_TRIP, Comparison, Finding, choose_lane, data_finding
from ...findings import Problem
from ...option_spec import SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ...stack import fingerprint as fp
from ..base import Case, CheckScenario, Launch, Runner, Setup
from ..shared.state_pieces import merge_boundaries
from . import checks, plan


class CheckpointScenario(CheckScenario):
    """Checkpoint round trips, resharding, exact resume and cross-platform portability."""

    name = plan.NAME
    rank_entry = "pytest_gpuregress.scenarios.checkpoint.rank:run"
    options = SCENARIO_OPTIONS["checkpoint"]  # declared with the plugin's: pytest reads them without importing this

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return plan.config(setup)

    def cases(self, setup: Setup) -> list[Case]:
        return plan.cases(setup)

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        # The multi-launch cases (sharded, resume) are launched by experiment(), in order.
        out = [plan.main_launch(setup, _root(setup), model)
               for model in dict.fromkeys(c.data.get("model") for c in cases if c.data["part"] in plan.MAIN_PARTS)]
        if any(c.launch == "portability" for c in cases):
            out.append(plan.portability_launch(setup, _root(setup), setup.option("portable-checkpoint")))
        return out

    def experiment(self, case: Case, run: Runner, setup: Setup) -> RunRecord | None:
        if case.data["part"] == "resume":
            return self._resume(run, setup, case.data.get("model"))
        if case.data["part"] == "sharded":
            return self._reshard(case, run, setup)
        return None

    def _save_then_load(self, run: Runner, launches: Callable[[str | None], tuple[Launch, Launch]]
                        ) -> tuple[RunRecord, RunRecord]:
        """The saving launch, then the loading one on the folder it saved, which is removed after."""
        saved = run(self, launches(None)[0])
        folder = saved.results["folder"]
        try:
            return saved, run(self, launches(folder)[1])
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _resume(self, run: Runner, setup: Setup, model: str | None) -> RunRecord:
        straight = run(self, plan.main_launch(setup, _root(setup), model))
        first, second = self._save_then_load(run, lambda f: plan.resume_launches(setup, _root(setup), f, model))
        k = plan.resume_at(straight.config)
        findings, table = checks.resume_findings(straight, first, second, k)
        record = RunRecord(scenario=self.name, config=straight.config, platform_key=straight.platform_key,
                           world_size=straight.world_size, fingerprint=straight.fingerprint,
                           results={"resume": findings, "resume_table": table})
        if checks.same_processes(first, second):
            record.notes.append("the second half of the resume case ran in the processes of the first (in place, or "
                                "a reused worker): its state still came only from the checkpoint folder, with every "
                                "generator scrambled before the load")
        return record

    def _reshard(self, case: Case, run: Runner, setup: Setup) -> RunRecord:
        n, m = int(case.data["save"]), int(case.data["load"])
        saved, loaded = self._save_then_load(run, lambda f: plan.reshard_launches(case, setup, _root(setup), f))
        error = loaded.results.get("load_error")
        findings = ([f"loading at world size {m} failed: {error}"] if error
                    else checks.reshard_findings(saved.results["hashes"], loaded.results["hashes"], n, m))
        return RunRecord(scenario=self.name, config=saved.config, platform_key=saved.platform_key,
                         world_size=saved.world_size, results={"sharded": findings})

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Rank 0's record, with every rank's generator digests and process ids."""
        merged = super().merge(records)
        boundaries = [r.results["boundary"] for r in records if "boundary" in r.results]
        if boundaries:
            merged.results["boundary"] = merge_boundaries(boundaries)
        merged.results["pid"] = {k: v for r in records for k, v in r.results.get("pid", {}).items()}
        return merged

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        part = case.data["part"]
        if part in ("resume", "sharded"):
            findings = checks.prefixed(case.id, record.results.get(part, ["did not run"]))
            return findings + (record.results.get("resume_table", []) if findings else [])
        return checks.part_findings(case.id, record.results.get(part))

    def reference_name(self, case: Case) -> str | None:
        if case.data["part"] != "full_state_dict":
            return None
        return plan.REFERENCE if "model" not in case.data else f"{plan.REFERENCE}-{case.data['model']}"

    def compare(self, reference: RunRecord, record: RunRecord, case: Case, lane: str) -> Comparison:
        """The trained checkpoint against the reference's: bit for bit on the reference's stack; elsewhere the
        loss curve within the tolerant limit (what a checkpoint means on another stack is portability's case)."""
        chosen, reason = choose_lane(reference, record, lane)
        findings = _curve(reference, record, chosen)
        if chosen == "exact":
            findings += _arrays(reference, record)
        data_finding(reference, record, findings)  # a random stream that moved: data, not the checkpoint
        return Comparison(chosen, reason, findings, fp.diff(reference.fingerprint, record.fingerprint))

    def summary(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        port = (records.get("portability") or RunRecord("", {}, "", 0)).results.get("portability")
        if not port or "deviation_from_bundle" not in port:
            return []
        return [f"portability: {port['bundle']} (recorded on {port['recorded_on']}) loaded on {port['device']}: "
                f"{port['lane']} lane, logits {port['deviation_from_bundle']:.3g} from the bundle's, "
                f"{port['deviation_from_float64']:.3g} from float64 (bound {port['bound']:.3g}), "
                f"{len(port['checksums'])} tensor checksums"]


def _root(setup: Setup) -> str:
    return str(Path(setup.option("checkpoint-dir") or tempfile.gettempdir()).resolve())


def _curve(reference: RunRecord, record: RunRecord, lane: str) -> list[Finding]:
    """The training curve against the reference's. It is trained before the checkpoint is saved, so a difference
    in it is no checkpoint's doing: said as a fact (``before_save``), which triage names."""
    expected, got = reference.series.get("loss", []), record.series.get("loss", [])
    lines = checks.curve_findings(expected, got, lane == "exact", what="this run differs from the reference")
    step = checks.first_curve_difference(expected, got, lane == "exact")
    return [Finding("loss", f"{line}; every step of it ran before the checkpoint was saved, so it is no "
                    "checkpoint's doing", step=step, facts={"before_save": True}) for line in lines]


def _arrays(reference: RunRecord, record: RunRecord) -> list[Finding]:
    """The bundle's tensors and logits, bit for bit (the exact lane)."""
    from .portable import describe_difference

    out = []
    keys = sorted(k for k in reference.arrays if not k.startswith("envelope/"))
    missing = [k for k in keys if k not in record.arrays]
    if missing:
        out.append(Finding(ROUND_TRIP, f"{len(missing)} of the reference's {len(keys)} arrays are "
                           f"missing from this run, first {missing[0]} (its round trip failed: see above)"))
    out += [Finding("checkpoint", f"{key}: {describe_difference(reference.arrays[key], record.arrays[key])} against "
                    "the reference", tensor=key)
            for key in keys if key in record.arrays and not _same_array(reference.arrays[key], record.arrays[key])]
    return out


def _same_array(expected: Any, got: Any) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and got.tobytes() == expected.tobytes()


SCENARIO = CheckpointScenario()
