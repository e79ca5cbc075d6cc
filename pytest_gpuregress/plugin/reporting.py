"""What the plugin writes: the report header, JUnit properties and HTML extras per test, and the closing summary."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..components import parts
from ..launch.net import exposed_addresses
from ..scenarios import registry
from ..stack.determinism import header_lines as determinism_lines
from ..stack.fingerprint import collect
from ..stack.fingerprint import header_lines as fingerprint_lines
from ..stack.known_issues import cited_lines, matching
from ..stack.known_issues import header_lines as known_issue_lines
from .outcomes import outcome_lines, summary_table

if TYPE_CHECKING:
    from .session import GpuRegressSession

# The key figures of a test, attached as JUnit properties (record_property's mechanism).
JUNIT_FIGURES = ("lane", "component", "triage_verdict", "triage_rule", "bisect", "first_differing_step", "worst_over_tolerance",
                 "platform_key", "seconds", "wrong_elements",
                 "perf", "kernel_changes", "busiest_expert_share", "stack_changes", "faults_fired",
                 "consensus_verdict", "consensus_devices", "consensus_dissenters", "consensus_table", "consensus_links")


def header_lines(session: GpuRegressSession) -> list[str]:
    options, plat = session.options, session.platform
    fingerprint = collect(plat.device_kind, plat.backend, plat.world_size)
    lines = fingerprint_lines(fingerprint)
    lines += determinism_lines(plat.device_kind)  # on a GPU, or where determinism cannot be had: why
    session.matched_issues = matching(session.known_issues, fingerprint)  # what a failed case cites
    lines += known_issue_lines(session.matched_issues)
    lines.append(_run_line(session))
    lines += session.selection.rank_header()
    lines.append(f"gpuregress artifacts: {session.output_dir} (failed runs, plots, logs; --gpuregress-artifacts)")
    if options.inject:
        lines.append(f"gpuregress faults injected: {'; '.join(options.inject)}")
    exposed = exposed_addresses() if plat.in_place else []
    if exposed:
        lines.append(
            f"gpuregress WARNING: this rank and its torchrun agent listen beyond loopback on {', '.join(exposed)}: "
            "on one machine bind the store with --rdzv-endpoint=127.0.0.1:PORT (static: --master-addr=127.0.0.1), "
            "across machines choose the interface with --local-addr")
    for scenario in registry().values():
        lines += scenario.header(session.setup)
    return lines


def _run_line(session: GpuRegressSession) -> str:
    """How the ranks run, and whether this run records or compares references, and where."""
    options, plat, places = session.options, session.platform, session.places
    mode = "in place under torchrun" if plat.in_place else "spawned locally"
    doing = "RECORDING" if options.record else "RECORDING missing and comparing" if options.record_missing else "comparing"
    # An explicit folder means that folder only (places.py): the shipped ones are no fallback then.
    shipped = "" if options.record or options.reference_dir is not None else f" (else shipped: {places.shipped_root})"
    return (f"gpuregress run: {plat.world_size} {plat.backend} ranks on {plat.device_kind} ({mode}); {doing} "
            f"references in {places.user_root}{shipped}")


def attach_figures(item: pytest.Item, report: pytest.TestReport, figures: dict[str, Any]) -> None:
    """The test's key figures as JUnit properties (they reach JUnit through the teardown report, as
    record_property's do) and, with pytest-html installed, the plot and the stack's changes as extras."""
    # A list (the stack's changes) as one attribute value: "torch 2.12.0 -> 2.13.0; device.cpu_model: ...".
    item.user_properties.extend((k, "; ".join(map(str, v)) if isinstance(v, list) else v)
                                for k in JUNIT_FIGURES if (v := figures.get(k)) is not None)
    try:
        from pytest_html import extras
    except ImportError:
        return
    added = []
    if figures.get("plot"):  # embedded, so the report is one file a CI can upload
        added.append(extras.png(base64.b64encode(Path(figures["plot"]).read_bytes()).decode(), name="comparison plot"))
    if figures.get("stack_changes"):
        added.append(extras.text("\n".join(figures["stack_changes"]), name="stack changes since the reference"))
    report.extras = [*getattr(report, "extras", []), *added]


def cite_known_issues(item: pytest.Item, report: pytest.TestReport, session: GpuRegressSession) -> None:
    """A failed case cites the known issues of this stack (the header's KNOWN ISSUE lines) whose component its
    findings name: the bug may be a known one, with a source and a workaround. The failure stands (a match is a
    warning): the case's numbers say whether the bug hit this run."""
    if not report.failed:
        return
    if session.matched_issues is None:  # no header was printed (--no-header): match now, once
        plat = session.platform
        session.matched_issues = matching(session.known_issues, collect(plat.device_kind, plat.backend, plat.world_size))
    # The components its findings name (its ``component`` figure), each with the parts it is made of.
    named = {part for name in str(session.figures.get("component") or "").split(", ") for part in parts(name)}
    cited = [issue for issue in session.matched_issues if issue.component in named]
    if cited:
        report.sections.append(("gpuregress known issues", "\n".join(cited_lines(cited))))
        item.user_properties.append(("known_issues", ", ".join(issue.id for issue in cited)))  # JUnit, as the figures


def _outcome_lines(session: GpuRegressSession) -> list[str]:
    """The outcomes and their table, where the artifacts are, and the references no case reads."""
    lines = [*outcome_lines(session.outcomes), *summary_table(session.outcomes),
             f"artifacts (failed runs, plots, logs): {session.output_dir}"]
    unused = session.places.unused({o.platform_key for o in session.outcomes})
    if unused:
        lines.append(f"references no case of this configuration reads ({len(unused)}, in {session.places.user_root}): "
                     f"{', '.join(unused)}; left over from a removed model or case, or read only with an option "
                     "not given this run (--gpuregress-model ...): delete those no longer wanted")
    return lines


def closing_sections(session: GpuRegressSession, left_out: list[str]) -> list[tuple[str, list[str]]]:
    """(section title, lines) of the closing summary: the outcomes and their table and the header's word on a
    built-in suite ``left_out``, then each scenario's own."""
    own = [*(_outcome_lines(session) if session.outcomes else []), *left_out]
    scenarios = [(f"gpuregress {name}", lines) for name in session.launches.launched
                 if (lines := _scenario_lines(session, name))]
    return [("gpuregress", own), *scenarios] if own else scenarios


def _scenario_lines(session: GpuRegressSession, name: str) -> list[str]:
    """Scenario ``name``'s own summary of its launches (a failed one as None), and where its records were kept."""
    launches = session.launches
    records = {key: (None if isinstance(r, Exception) else r) for key, r in launches.launched[name].items()}
    lines = registry()[name].summary(records, session.setup)
    return lines + [f"{key}: record in {path}" for (sc, key), path in launches.saved.items() if sc == name]
