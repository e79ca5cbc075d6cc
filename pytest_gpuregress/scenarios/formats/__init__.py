"""Scenario ``formats``: FP8, FP4 and MX conformance, and quantized checkpoints across vendors.

Session side, torch-free. One launch measures everything on every rank (``rank.py``); each case (decode, encode,
behaviour, quantized, inspect, io, scaled_mm) reads its part of the merged record, and those with a reference
share one, ``formats``. The cases: docs/formats.md; bug classes: docs/faults.md section 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ... import activities as act
from ...comparison.compare import Comparison, Finding, choose_lane
from ...findings import CheckFinding, Problem, text_of
from ...option_spec import SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ...stack import fingerprint as fp
from ...warn import warn_at_test
from ..base import Case, CheckScenario, Launch, Setup
from . import grid, judge, summary
from .catalog import FORMATS, IO_PATHS, IO_SCHEMES, MX_BLOCK, SCHEMES

REFERENCE = "formats"

# Casts and checkpoint files on each device. The io cases also read fp8 tensors back through the loaders each path
# calls (DCP reads its files with torch.load; transformers 5.x with safetensors.safe_open).
EXERCISED = act.exercises(act.FP8_CODECS, act.FORWARD,
                          summary="no optimizer step and no collective: casts and checkpoint files on each device")
LOADERS_OF_PATH = {"safetensors": ("safetensors",), "safe_open": ("safe_open",), "torch_load": ("torch_load",),
                   "dcp": ("dcp", "torch_load"), "transformers": ("transformers", "safe_open")}
NO_E5M2 = {"transformers": "transformers' fine-grained fp8 layout is e4m3fn only: no e5m2 tensor goes through it"}


def io_exercised(path: str) -> act.Exercises:
    """An io case: the formats' own checks, and fp8 (and e5m2) tensors read back through its path's loaders."""
    loaders = LOADERS_OF_PATH[path]
    does = {act.fp8_loader(loader) for loader in loaders}
    if path in NO_E5M2:
        return act.Exercises(EXERCISED.does | does, EXERCISED.summary, {act.e5m2_loader(): NO_E5M2[path]})
    does |= {act.e5m2_loader(loader) for loader in loaders}
    return act.Exercises(EXERCISED.does | does, EXERCISED.summary, {})


class FormatsScenario(CheckScenario):
    """FP8, FP4 and MX conformance against ml_dtypes, and quantized checkpoints across vendors."""

    name = "formats"
    rank_entry = "pytest_gpuregress.scenarios.formats.rank:run"
    options = SCENARIO_OPTIONS["formats"]  # declared with the plugin's: pytest reads them without importing this

    def cases(self, setup: Setup) -> list[Case]:
        out = [Case(f"{part}-{f}", data={"part": part, "format": f}) for part in ("decode", "encode", "behaviour")
               for f in FORMATS]
        out += [Case(f"quantized-{s}", data={"part": "quantized", "scheme": s}) for s in SCHEMES]
        out.append(Case("inspect", data={"part": "inspect"}))
        out += [Case(f"io-{p}", data={"part": "io", "path": p}, exercises=io_exercised(p)) for p in IO_PATHS]
        if setup.device_kind == "cuda":
            out.append(Case("scaled_mm", data={"part": "scaled_mm"}))
        out += [Case(f"quantized-{s}-{m.name}", launch=f"quantized-{m.name}",
                     data={"part": "quantized", "scheme": s, "model": m.name}) for m in setup.models for s in SCHEMES]
        return [replace(c, exercises=c.exercises or EXERCISED, family=self.name) for c in out]

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return self.launch_config(setup, [c for c in self.cases(setup) if c.launch == "default"])

    def launch_config(self, setup: Setup, cases: list[Case], model: str | None = None) -> dict[str, Any]:
        """What every rank runs. ``run`` and ``format_changes`` are kept out of the stored config
        (catalog.SESSION_ONLY), so any selection compares with one reference. ``model``: a user's model
        (--gpuregress-model, by name) in place of the tiny Llama."""
        from ...training.models import architecture_of

        # The CPU size on every device: number formats do not need model scale, and the host-side
        # oracle and exact checksums stay under a second for its 100k weights; the GPU size's 155M
        # would take minutes per scheme. The device still quantizes, dequantizes and runs the model.
        parts: dict[str, list[str]] = {}
        for case in cases:
            parts.setdefault(case.data["part"], []).append(case_key(case))
        quantized = list(SCHEMES) if "inspect" in parts or "io" in parts else parts.get("quantized", [])
        if "io" in parts:  # the e5m2 family's files, for the io cases only ("run" is not part of the reference)
            quantized += list(IO_SCHEMES)
        identity = {"model": "tiny-llama", "model_size": "cpu"}
        if model is not None:
            identity.update(setup.model(model).config_fields())
        return {
            **identity, "seed": 0, "batch": [2, 16], "dtype": "fp32",
            "model_architecture": architecture_of(identity), "block_size": MX_BLOCK,
            "grid": grid.grid_digest(), "formats": list(FORMATS), "schemes": list(SCHEMES),
            "run": {"decode": parts.get("decode", []),
                    "encode": sorted(set(parts.get("encode", [])) | set(parts.get("behaviour", []))),
                    "quantized": quantized, "scaled_mm": "scaled_mm" in parts, "io": parts.get("io", [])},
            "format_changes": setup.option("format-changes") or "fail",
        }

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        by_launch: dict[str, list[Case]] = {}
        for case in cases:
            by_launch.setdefault(case.launch, []).append(case)
        return [Launch(key, self.launch_config(setup, group, group[0].data.get("model")))
                for key, group in by_launch.items()]

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Rank 0's record, plus which cases another rank measured otherwise, with that rank's own findings."""
        merged = records[0]
        disagree: dict[str, dict[str, list[str]]] = {}
        for rank, other in enumerate(records[1:], start=1):
            for case_id in judge.rank_differences(merged, other):
                part, _, key = case_id.partition("-")
                disagree.setdefault(case_id, {})[str(rank)] = [text_of(p) for p in closed_form(part, key, other)]
        merged.results["rank_disagreements"] = disagree
        return merged

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        key = case_key(case)
        problems = closed_form(case.data["part"], key, record)
        if case.data["part"] == "io":
            _io_outcome(key, record, problems)
        return problems + _disagreements(case, key, record)

    def reference_name(self, case: Case) -> str | None:
        if case.data["part"] not in ("behaviour", "quantized"):
            return None
        return REFERENCE if "model" not in case.data else f"{REFERENCE}-{case.data['model']}"

    def compare(self, reference: RunRecord, record: RunRecord, case: Case, lane: str) -> Comparison:
        chosen, reason = choose_lane(reference, record, lane)
        part = case.data["part"]
        key = case.data.get("format") or case.data["scheme"]
        if part == "behaviour":
            findings = self._behaviour(judge.behaviour_changes(FORMATS[key], reference, record), record)
        else:
            findings = judge.quantized_findings(key, reference, record, chosen)
        # A reference recorded from a run that failed its own checks must not vouch for anything.
        findings += [Finding("reference", f"the reference itself fails: {text_of(p)}")
                     for p in judge.stale_reference(part, key, reference)]
        return Comparison(chosen, reason, findings, fp.diff(reference.fingerprint, record.fingerprint))

    def _behaviour(self, changes: list[str], record: RunRecord) -> list[Finding]:
        """Findings, or in warn mode a warning and a summary line each (the case passes)."""
        if record.results.get("session", {}).get("format_changes") != "warn":
            return [Finding("behaviour", change) for change in changes]
        record.results.setdefault("warned", []).extend(changes)
        for change in changes:
            warn_at_test(judge.FormatBehaviourChanged(change))
        return []

    def header(self, setup: Setup) -> list[str]:
        return [] if setup.device_kind == "cuda" else [f"gpuregress formats: {summary.SCALED_MM_OFF_CPU}"]

    def summary(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        record = records.get("default")
        return [] if record is None else summary.lines(record, setup.device_kind != "cuda")


SCENARIO = FormatsScenario()


def _io_outcome(key: str, record: RunRecord, problems: list[Problem]) -> None:
    """An io case's known stack issues warn; a path this rank could not try, with nothing wrong, is not applicable."""
    result = record.results.get("io", {}).get(key) or {}
    for text in result.get("known_issues", []):
        warn_at_test(judge.KnownStackIssue(f"checkpoint I/O {key}: {text}"))
    if result.get("skipped") and not problems:
        from ...errors import NotApplicable

        raise NotApplicable(f"io-{key}: {result['skipped']}")


def _disagreements(case: Case, key: str, record: RunRecord) -> list[Problem]:
    """A finding per other rank that measured the case otherwise than rank 0 (merge), with its own first finding."""
    # Keyed by the case of the tiny Llama's launch: a user model's launch has the same parts, one per scheme.
    measured = case.id if "model" not in case.data else f"quantized-{key}"
    problems: list[Problem] = []
    for rank, theirs in record.results.get("rank_disagreements", {}).get(measured, {}).items():
        text = f"{case.id}: rank {rank} measured otherwise than rank 0: the devices of this machine disagree"
        if theirs:
            text += f"; its own findings: {theirs[0]}" + (f" (and {len(theirs) - 1} more)" if len(theirs) > 1 else "")
        problems.append(CheckFinding("format", text))
    return problems


def case_key(case: Case) -> str:
    """What a case's part is about: its format, scheme or I/O path."""
    return str(case.data.get("format") or case.data.get("scheme") or case.data.get("path", ""))


def closed_form(part: str, key: str, record: RunRecord) -> list[Problem]:
    """The reference-free findings of one case's part of ``record`` (``key``: its format or scheme)."""
    return _CLOSED_FORM.get(part, lambda key, record: judge.scaled_mm_problems(record))(key, record)


_CLOSED_FORM: dict[str, Callable[[str, RunRecord], list[Problem]]] = {
    "decode": lambda key, record: judge.decode_problems(FORMATS[key], record),
    "encode": lambda key, record: judge.encode_problems(FORMATS[key], record),
    # behaviour: judged against the reference, unless its cast raised
    "behaviour": lambda key, record: judge.raised(f"encode-{key}", record),
    "quantized": judge.quantized_problems,
    "inspect": lambda key, record: judge.inspect_problems(record),
    "io": judge.io_problems,
}
