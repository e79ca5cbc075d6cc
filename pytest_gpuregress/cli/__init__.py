"""``gpuregress``: inspect the stack and stored references without running pytest.

    gpuregress env                      the stack fingerprint of this machine, as JSON
    gpuregress show DIR                 what a reference holds: scenario, platform, steps, loss, stack
    gpuregress compare REF RUN          compare two stored references or records, as the plugin would
    gpuregress scenarios                the installed scenarios: built-in and from other packages
    gpuregress inspect-fp8 FILE         do a safetensors file's fp8/fp4 codes match their tags and scales?
    gpuregress plot REF [RUN]           the comparison plot of a reference and a run (needs [plots])
    gpuregress portability CKPT --config CONFIG
                                        a checkpoint's logits and checksums on this machine, against another's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import GpuRegressError
from ..reference.compare import compare_training
from ..reference.failfast import truncated_reference
from ..reference.record import RunRecord
from ..reference.report import format_comparison
from ..reference.store import MANIFEST, ReferenceLocation, read_reference
from . import inspect_fp8, plot, portability


def load_record(path: Path) -> RunRecord:
    """A reference directory (verified against its manifest) or a bare record directory."""
    if (path / MANIFEST).exists():
        return read_reference(ReferenceLocation(path.parent.parent, path.parent.name, path.name))
    return RunRecord.load(path)


def _env(args: argparse.Namespace) -> int:
    from ..stack.fingerprint import collect
    from ..stack.platforms import resolve_platform

    plat = resolve_platform(args.device)
    print(json.dumps(collect(plat.device_kind, plat.backend, plat.world_size), indent=1, sort_keys=True))
    return 0


def _show(args: argparse.Namespace) -> int:
    record = load_record(Path(args.path))
    loss = record.series.get("loss", [])
    versions = record.fingerprint.get("versions", {})
    print(f"scenario:  {record.scenario}")
    print(f"platform:  {record.platform_key} ({record.world_size} ranks)")
    print(f"steps:     {record.steps}" + (f", loss {loss[0]:.6g} -> {loss[-1]:.6g}" if loss else ""))
    print(f"stack:     torch {versions.get('torch')}, transformers {versions.get('transformers')}")
    print(f"config:    {json.dumps(record.config, sort_keys=True)}")
    print(f"tensors:   {len(record.arrays)} arrays, {len(record.digests)} weight digests")
    return 0


def _compare(args: argparse.Namespace) -> int:
    reference, run = load_record(Path(args.reference)), load_record(Path(args.run))
    if run.results.get("fail_fast"):  # stopped early: compare the steps it ran, as the plugin did
        reference = truncated_reference(reference, run.steps)
    comparison = compare_training(reference, run, lane=args.lane)
    if comparison.passed:
        print(f"same within the {comparison.lane} lane ({comparison.lane_reason})")
        return 0
    print(format_comparison(comparison, scenario=reference.scenario, platform_key=run.platform_key,
                            reference_path=args.reference, record_hint="pytest --gpuregress --gpuregress-record"))
    return 1


def _scenarios(args: argparse.Namespace) -> int:
    from ..scenarios import registry

    for name, scenario in registry().items():
        module = type(scenario).__module__
        doc = (type(scenario).__doc__ or (__import__(module, fromlist=["_"]).__doc__ or "")).strip().splitlines()
        print(f"{name:<14} {scenario.kind:<9} {module}  {doc[0] if doc else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuregress", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print this machine's stack fingerprint")
    env.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    env.set_defaults(func=_env)
    show = sub.add_parser("show", help="summarise a stored reference or record")
    show.add_argument("path")
    show.set_defaults(func=_show)
    cmp = sub.add_parser("compare", help="compare a run with a reference; exit 1 when they differ")
    cmp.add_argument("reference")
    cmp.add_argument("run")
    cmp.add_argument("--lane", choices=["auto", "exact", "tolerant"], default="auto")
    cmp.set_defaults(func=_compare)
    scenarios = sub.add_parser("scenarios", help="list the installed scenarios")
    scenarios.set_defaults(func=_scenarios)
    inspect_fp8.add_parser(sub)
    portability.add_parser(sub)
    plot.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GpuRegressError as exc:
        print(f"gpuregress: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
