"""``gpuregress``: inspect the stack and stored references without running pytest.

Subcommands: env, show, list, compare, scenarios, inspect-fp8, plot, portability, prune (``--help`` says each).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from ..comparison.report import format_comparison
from ..errors import GpuRegressError
from ..reference.store import load_record
from . import portability, references

FP8_METADATA_SHOWN = ("quantization", "element_format", "scale_format", "block_size", "scale_rule")


def _env(args: argparse.Namespace) -> int:
    from ..stack.fingerprint import collect, header_lines
    from ..stack.platforms import resolve_platform

    plat = resolve_platform(args.device)
    fingerprint = collect(plat.device_kind, plat.backend, plat.world_size)
    if args.json:  # for machines: every field, and what a bisect of an upgrade would need (triage/bisect.py)
        print(json.dumps({**fingerprint, "bisect": _bisect_needs(fingerprint)}, indent=1, sort_keys=True))
        return 0
    for line in header_lines(fingerprint):  # the report header's words
        print(line.removeprefix("gpuregress "))
    comm = fingerprint["comm"]
    print(f"ranks: {comm.get('world_size')} on {comm.get('backend')}")
    print("every field, for machines: gpuregress env --json")
    return 0


def _bisect_needs(fingerprint: dict) -> dict:
    """What --gpuregress-bisect needs of this environment: the versions (the fingerprint's packages, which every
    reference keeps), and the packages an overlay could not replace here, with the reason."""
    from ..triage.bisect import Change, why_untestable

    packages = fingerprint.get("packages") or {}
    fixed = {name: why for name, version in packages.items()
             if (why := why_untestable(Change(name, version, version))) is not None}
    return {"packages_recorded": len(packages), "not_overlayable": fixed,
            "how": "a reference keeps every package's version; --gpuregress-bisect reverts those that changed with "
                   "pip install --no-deps --target, from --gpuregress-wheelhouse first, else pip's index"}


def _show(args: argparse.Namespace) -> int:
    record = load_record(_record_folder(args.path))
    loss = record.series.get("loss", [])
    versions = record.fingerprint.get("versions", {})
    print(f"scenario:  {record.scenario}")
    print(f"platform:  {record.platform_key} ({record.world_size} ranks)")
    print(f"steps:     {record.steps}" + (f", loss {loss[0]:.6g} -> {loss[-1]:.6g}" if loss else ""))
    print(f"stack:     torch {versions.get('torch')}, transformers {versions.get('transformers')}")
    print(f"config:    {json.dumps(record.config, sort_keys=True)}")
    print(f"tensors:   {len(record.arrays)} arrays, {len(record.digests)} weight digests")
    return 0


def _record_folder(given: str) -> Path:
    """A folder holding a record (a reference or a kept run), or a usage error that says what is wrong with it: a
    path that is not there is a typo, not a reference to re-record."""
    path = Path(given)
    if not path.exists():
        raise GpuRegressError(f"{given}: no such file or folder (a reference or a kept run: the folder that holds "
                              "record.json, as the failure report printed it)")
    if not path.is_dir():
        raise GpuRegressError(f"{given}: not a folder; give the folder that holds record.json")
    return path


def _compare(args: argparse.Namespace) -> int:
    """Judge a kept run as the plugin did: its scenario's own checks, and against REF where given."""
    from ..scenarios.comparator import for_kept

    if len(args.paths) > 2:
        raise GpuRegressError(f"compare takes [REF] RUN, not {len(args.paths)} paths")
    *given, run_path = args.paths
    run = load_record(_record_folder(run_path))
    reference = load_record(_record_folder(given[0])) if given else None
    comparator = for_kept(run, lane=args.lane)
    judged = _judged_case(comparator)
    if reference is None and (judged is None or judged[0].reference_name(judged[1]) is not None):
        raise GpuRegressError(f"{run_path} is judged against a reference: gpuregress compare REFERENCE {run_path}")
    judgement = comparator.judge(reference, run)
    what = f"{judged[0].name} case {judged[1].id}" if judged else run.scenario
    comparison = judgement.comparison
    if judgement.passed:
        lane = f" within the {comparison.lane} lane ({comparison.lane_reason})" if comparison is not None else ""
        print(f"{what}: passed{lane}")
        return 0
    print(f"{what}: FAILED")
    _print_failure(judgement, reference, run, args.paths[0], comparator)  # paths[0]: REF, where a comparison failed
    return 1


def _judged_case(comparator: Any) -> tuple[Any, Any] | None:
    """(scenario, case) of the built-in case that judged a kept run; None for a user's own run (for_kept gives
    both or neither)."""
    sc, case = comparator.scenario, comparator.case
    return (sc, case) if sc is not None and case is not None else None


def _print_failure(judgement: Any, reference: Any, run: Any, reference_path: str, comparator: Any) -> None:
    """A failed judgement's findings, and a failed comparison's report as the plugin prints it."""
    from ..triage.naming import described, name_findings

    for problem in judgement.problems:
        print(described(problem))
    comparison = judgement.comparison
    if comparison is not None and not comparison.passed:
        name_findings(comparison)
        print(format_comparison(comparison, scenario=reference.scenario if reference else run.scenario,
                                platform_key=run.platform_key, reference_path=reference_path,
                                record_hint=_record_hint(comparator)))


def _record_hint(comparator: Any) -> str:
    """The command that records the judged case's reference: its node id where a built-in scenario judged it."""
    import shlex

    from ..scenarios import test_id

    judged = _judged_case(comparator)
    if judged is None:
        return "pytest --gpuregress --gpuregress-record <the test that checks this run>"
    return shlex.join(["pytest", "--gpuregress", "--gpuregress-record", f"gpuregress::{test_id(judged[0].name, judged[1].id)}"])


def _scenarios(args: argparse.Namespace) -> int:
    from ..scenarios import registry

    for name, scenario in registry().items():
        print(f"{name:<14} {scenario.kind:<9} {type(scenario).__module__}  {_summary(name, scenario)}")
    return 0


def _summary(name: str, scenario: Any) -> str:
    """The first line of the scenario's docstring (else its module's), as a terminal shows it: no doc markup, and
    not its name, which is in the first column."""
    module = type(scenario).__module__
    doc = (type(scenario).__doc__ or (__import__(module, fromlist=["_"]).__doc__ or "")).strip().splitlines()
    summary = doc[0].replace("``", "").replace("`", "") if doc else ""
    return re.sub(rf"^Scenario {re.escape(name)}:\s*", "", summary)


def _inspect_fp8(args: argparse.Namespace) -> int:
    """Do a safetensors file's fp8 and fp4 codes mean what their tags say? The formats scenario's diagnosis
    (scenarios/formats/diagnose.py), on the file read as safetensors only; exit 1 on a finding."""
    from ..scenarios.formats import checkpoint, diagnose

    ckpt = checkpoint.read(Path(args.file))
    report = diagnose.diagnose(ckpt)
    print(_fp8_summary(report, ckpt.metadata))
    for note in report.notes:
        print(f"  note: {note}")
    if not report.tensors:
        print("  nothing to check: no fp8 or fp4 tensor with a scale")
        return 0
    if not report.findings:
        print("  clean: codes, tags, metadata and scales agree")
        return 0
    texts = [f.text() for f in report.findings] if args.all else report.grouped()
    print(f"  {len(report.findings)} findings:")
    for text in texts:
        print("  " + text.replace("\n", "\n  "))
    return 1


def _fp8_summary(report: Any, metadata: dict[str, str]) -> str:
    """The file's quantized tensors by tag, and the quantization metadata it declares."""
    shown = ", ".join(f"{k}={metadata[k]}" for k in FP8_METADATA_SHOWN if k in metadata) or "none"
    tags = ", ".join(f"{tag} x{count}" for tag, count in sorted(report.tags.items())) or "none"
    return f"{report.path}: {report.tensors} quantized tensors ({tags}); metadata: {shown}"


def _plot(args: argparse.Namespace) -> int:
    """The failure report's figure, drawn from stored records."""
    from ..comparison.plot import plot_comparison

    reference = load_record(Path(args.reference))
    other = load_record(Path(args.run)) if args.run else None
    path = plot_comparison(reference, other, Path(args.output), title=reference.scenario)
    print(f"plot: {path}")
    return 0


def _version() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" from a tree that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pytest-gpuregress")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuregress", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print this machine's stack fingerprint, in words")
    env.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    env.add_argument("--json", action="store_true", help="every field, as JSON")
    env.set_defaults(func=_env)
    show = sub.add_parser("show", help="summarise a stored reference or record")
    show.add_argument("path")
    show.set_defaults(func=_show)
    cmp = sub.add_parser("compare", help="judge a kept run as the plugin did (against REF where it has one); "
                                          "exit 1 when it fails")
    cmp.add_argument("paths", nargs="+", metavar="[REF] RUN", help="a reference and a run, or a check case's run alone")
    cmp.add_argument("--lane", choices=["auto", "exact", "tolerant"], default=None,
                     help="the comparison lane (default: the one the run was judged in)")
    cmp.set_defaults(func=_compare)
    scenarios = sub.add_parser("scenarios", help="list the installed scenarios")
    scenarios.set_defaults(func=_scenarios)
    fp8 = sub.add_parser("inspect-fp8", help="check the fp8/fp4 tensors of a safetensors file against their tags, "
                                             "metadata and scales; exit 1 on a finding")
    fp8.add_argument("file", help="a .safetensors file")
    fp8.add_argument("--all", action="store_true", help="one finding per tensor instead of one per kind")
    fp8.set_defaults(func=_inspect_fp8)
    portability.add_parser(sub)
    plot = sub.add_parser("plot", help="draw the comparison plot of a reference and a run (needs "
                                       "pytest-gpuregress[plots])")
    plot.add_argument("reference", help="a reference folder (or a kept run's record)")
    plot.add_argument("run", nargs="?", help="a run to set against it; without it the reference and its band")
    plot.add_argument("-o", "--output", default="gpuregress-plot.png", help="PNG to write (default: %(default)s)")
    plot.set_defaults(func=_plot)
    references.add_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GpuRegressError as exc:
        print(f"gpuregress: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
