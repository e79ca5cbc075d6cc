"""What the plugin writes (plugin/reporting.py): the report header, a test's JUnit properties and HTML extras, the
known issues a failed case cites, and the closing sections. On a session built directly, with stand-ins for
pytest's item and report: no pytest run, no rank."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.errors import RankFailure
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.outcomes import Outcome
from pytest_gpuregress.plugin.reporting import attach_figures, cite_known_issues, closing_sections, header_lines
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.stack.known_issues import HEADER_PREFIX, KnownIssue

PLATFORM = "cpu-gloo-w2-fp32"
# The header's run line: ranks, backend, device, how they start, what the run does with references, and where.
RUN_LINE = re.compile(r"gpuregress run: (\d+) (\w+) ranks on (\w+) \((.+?)\); (.+?) references in (\S+)"
                      r"(?: \(else shipped: (\S+)\))?")


def session(root: Path, **options: Any) -> GpuRegressSession:
    return GpuRegressSession(Options(enabled=True, device="cpu", **options), root, output_dir=root / "artifacts")


def issue(issue_id: str, component: str, device_kind: str = "cpu") -> KnownIssue:
    """A known issue of ``component`` on stacks whose device is ``device_kind``."""
    return KnownIssue(id=issue_id, component=component, affects=(("device.kind", device_kind),), symptom="wrong sums",
                      workaround="pin it", source=f"example/{issue_id}#1")


def stand_ins(*, failed: bool = True) -> tuple[Any, Any]:
    """What reporting reads and writes of a pytest item and its call report."""
    return SimpleNamespace(user_properties=[]), SimpleNamespace(failed=failed, sections=[])


def test_the_header_says_how_ranks_run_where_references_are_and_the_issues_of_this_stack(tmp_path: Path) -> None:
    """The run line names the ranks and the folders; a known issue whose conditions hold for this CPU stack is
    shown (and kept for a failed case to cite), another device's is not."""
    core = session(tmp_path)
    core.known_issues = [issue("cpu-sums", "kernel"), issue("gpu-sums", "kernel", device_kind="cuda")]
    lines = header_lines(core)
    (run,) = [m.groups() for line in lines if (m := RUN_LINE.fullmatch(line))]
    assert run == ("2", "gloo", "cpu", "spawned locally", "comparing", str(tmp_path / "reference_runs"),
                   str(core.places.shipped_root))
    assert [line for line in lines if line.startswith(HEADER_PREFIX)] == [
        f"{HEADER_PREFIX} cpu-sums (kernel): wrong sums",
        f"{HEADER_PREFIX} cpu-sums workaround: pin it [source: example/cpu-sums#1]"]
    assert [i.id for i in core.matched_issues or []] == ["cpu-sums"]
    assert any(line.startswith(f"gpuregress artifacts: {tmp_path / 'artifacts'} ") for line in lines)
    assert not any(line.startswith("gpuregress faults injected") for line in lines)


def test_the_header_of_a_recording_run_names_its_folder_alone_and_the_faults_injected(tmp_path: Path) -> None:
    """A recording writes the user's folder only, so no shipped fallback is named; injected faults are listed."""
    core = session(tmp_path, record=True, inject=("lora:mode=zero_lora_b",))
    lines = header_lines(core)
    (run,) = [m.groups() for line in lines if (m := RUN_LINE.fullmatch(line))]
    assert run[4:] == ("RECORDING", str(tmp_path / "reference_runs"), None)
    assert "gpuregress faults injected: lora:mode=zero_lora_b" in lines


def test_a_tests_figures_become_junit_properties_and_html_extras(tmp_path: Path) -> None:
    """The JUnit figures in their fixed order, a list as one '; '-joined value, unset and unknown ones left out;
    the plot embedded and the stack's changes as text, for pytest-html."""
    pytest.importorskip("pytest_html")
    plot = tmp_path / "fsdp.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    item, report = stand_ins()
    figures = {"stack_changes": ["torch 2.12.0 -> 2.13.0", "device.cpu_model: a -> b"], "seconds": 1.5,
               "component": "kernel", "lane": None, "not_a_figure": 3, "plot": str(plot)}
    attach_figures(item, report, figures)
    assert item.user_properties == [("component", "kernel"), ("seconds", 1.5),
                                    ("stack_changes", "torch 2.12.0 -> 2.13.0; device.cpu_model: a -> b")]
    assert [(extra["name"], extra["format_type"]) for extra in report.extras] == \
        [("comparison plot", "image"), ("stack changes since the reference", "text")]
    assert report.extras[1]["content"] == "torch 2.12.0 -> 2.13.0\ndevice.cpu_model: a -> b"


def test_a_failed_case_cites_the_known_issues_of_the_components_its_findings_name(tmp_path: Path) -> None:
    """``collective or kernel`` names both parts: both issues are cited, in a report section and a JUnit property;
    a checkpoint finding cites neither, and a passed case cites nothing."""
    core = session(tmp_path)
    core.matched_issues = [issue("nccl-tail", "collective"), issue("blas-flush", "kernel")]
    core.figures["component"] = "collective or kernel"
    item, report = stand_ins()
    cite_known_issues(item, report, core)
    ((title, text),) = report.sections
    assert title == "gpuregress known issues" and len(text.splitlines()) == 2
    assert "nccl-tail" in text.splitlines()[0] and "blas-flush" in text.splitlines()[1]
    assert item.user_properties == [("known_issues", "nccl-tail, blas-flush")]
    core.figures["component"] = "checkpoint"
    item, report = stand_ins()
    cite_known_issues(item, report, core)
    assert (report.sections, item.user_properties) == ([], [])
    core.figures["component"] = "kernel"
    item, report = stand_ins(failed=False)
    cite_known_issues(item, report, core)
    assert (report.sections, item.user_properties) == ([], [])


def test_without_a_header_the_issues_of_this_stack_are_matched_when_a_case_fails(tmp_path: Path) -> None:
    """--no-header printed none, so nothing was matched: the first failure matches the known issues now."""
    core = session(tmp_path)
    core.known_issues = [issue("cpu-sums", "kernel"), issue("gpu-sums", "kernel", device_kind="cuda")]
    core.figures["component"] = "kernel"
    assert core.matched_issues is None
    item, report = stand_ins()
    cite_known_issues(item, report, core)
    assert [i.id for i in core.matched_issues or []] == ["cpu-sums"]
    assert item.user_properties == [("known_issues", "cpu-sums")]


def test_the_closing_sections_hold_the_outcomes_then_each_scenarios_own_summary(tmp_path: Path) -> None:
    """The plugin's section: each outcome, its table, the artifacts, the user's references no case reads and the
    suite left out; then a section per launched scenario that has lines (a failed launch as 'did not run', where
    its record was kept); a scenario without lines has none."""
    refs = tmp_path / "refs"
    (refs / "removed-model" / PLATFORM).mkdir(parents=True)
    (refs / "removed-model" / PLATFORM / "manifest.json").write_text("{}")
    core = session(tmp_path, reference_dir=refs)
    core.outcomes.append(Outcome("fsdp", PLATFORM, "passed", "exact", "8 steps"))
    core.launches.launched = {"fsdp": {"default": RankFailure("rank 1 hung")},
                              "collectives": {"default": RankFailure("rank 0 raised")}}
    core.launches.saved = {("collectives", "default"): tmp_path / "artifacts" / "collectives"}
    sections = closing_sections(core, ["gpuregress built-in cases: not collected: --gpuregress-no-builtin"])
    assert [title for title, _ in sections] == ["gpuregress", "gpuregress collectives"]
    own = sections[0][1]
    assert own[0] == "fsdp cpu-gloo-w2-fp32: PASSED [exact lane] 8 steps"
    assert any(line.startswith("artifacts ") and line.endswith(f": {tmp_path / 'artifacts'}") for line in own)
    (unused,) = [m.groups() for line in own if (m := re.match(r"references no case .+? \((\d+), in (\S+)\): (.+?);", line))]
    assert unused == ("1", str(refs), "removed-model/cpu-gloo-w2-fp32")
    assert own[-1] == "gpuregress built-in cases: not collected: --gpuregress-no-builtin"
    collectives = sections[1][1]
    assert any(line.split() == ["default", "did", "not", "run"] for line in collectives)  # the protocol table's row
    assert collectives[-1] == f"default: record in {tmp_path / 'artifacts' / 'collectives'}"
    core.outcomes.clear()
    assert [title for title, _ in closing_sections(core, [])] == ["gpuregress collectives"]  # nothing of its own
