"""``gpuregress list`` and ``gpuregress prune``: the references a folder holds, and those no case reads.

``list`` reads each reference's two JSON files only (a damaged one is listed as such). ``prune`` is syrupy's
pruning of unused snapshots: it lists by default and deletes with ``--yes``; a reference only a user's own loop
reads is named with ``--keep``, and the shipped references are never pruned.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from ..errors import GpuRegressError

MANIFEST = "manifest.json"
HEADER = ("scenario", "platform", "recorded", "steps", "stack")


def add_parsers(sub: Any) -> None:
    parser = sub.add_parser("list", help="list the references a folder holds, with the stack that recorded each")
    parser.add_argument("folder", help="a reference folder (--gpuregress-reference-dir; the shipped reference_runs/)")
    parser.set_defaults(func=list_references)
    parser = sub.add_parser("prune", help="list (or with --yes delete) the references of a folder no case reads")
    parser.add_argument("folder", help="a reference folder (--gpuregress-reference-dir)")
    parser.add_argument("--model", action="append", default=[], metavar="MODEL",
                        help="a model whose cases read references too, as --gpuregress-model gives it (repeatable)")
    parser.add_argument("--keep", action="append", default=[], metavar="NAME",
                        help="a reference name to keep: one your own loop reads (repeatable)")
    parser.add_argument("--yes", action="store_true", help="delete them (without it they are only listed)")
    parser.set_defaults(func=prune)


def list_references(args: argparse.Namespace) -> int:
    folder = _reference_folder(args.folder)
    rows = [_row(manifest.parent) for manifest in sorted(folder.glob(f"*/*/{MANIFEST}"))]
    if not rows:
        print(f"{folder}: holds no reference")
        return 0
    print("\n".join(_table([HEADER, *rows])))
    return 0


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` in columns as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _reference_folder(given: str) -> Path:
    folder = Path(given)
    if not folder.is_dir():
        raise GpuRegressError(f"{folder}: no such folder; give the folder references are recorded in "
                              "(--gpuregress-reference-dir)")
    return folder


def _row(reference: Path) -> tuple[str, ...]:
    try:
        manifest = json.loads((reference / MANIFEST).read_text())
        record = json.loads((reference / "record.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return (reference.parent.name, reference.name, "-", "-", f"damaged: {type(exc).__name__}")
    record = record if isinstance(record, dict) else {}
    steps = len(record.get("series", {}).get("loss", []))
    return (reference.parent.name, reference.name, str(manifest.get("recorded_at", "?"))[:16].replace("T", " "),
            str(steps or "-"), _stack(record.get("fingerprint", {})))


def _stack(fingerprint: dict[str, Any]) -> str:
    """The stack that recorded a reference: torch, transformers, and the CPU (with its kernel set) or GPU."""
    versions, device = fingerprint.get("versions", {}), fingerprint.get("device", {})
    cpu = device.get("kind") == "cpu"
    where = (f"{device.get('cpu_model')} [{device.get('cpu_capability')}]" if cpu else device.get("name")) or "?"
    return f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}; {where}"


def read_names(models: list[str], base: Path) -> set[str]:
    """Every reference name a case of the installed scenarios reads, on the CPU and on GPUs, with ``models``."""
    from ..scenarios import Setup, registry
    from ..training.model_specs import parse_model

    specs = tuple(parse_model(m, base) for m in models)
    setups = [Setup("cpu", "gloo", 2, models=specs), Setup("cuda", "nccl", 2, models=specs)]
    return {name for setup in setups for sc in registry().values() for case in sc.cases(setup)
            if (name := sc.reference_name(case)) is not None}


def unread(folder: Path, read: set[str]) -> list[Path]:
    """The reference folders (``<name>/<platform>``) under ``folder`` whose name is not in ``read``."""
    return [manifest.parent for manifest in sorted(folder.glob(f"*/*/{MANIFEST}")) if manifest.parent.parent.name not in read]


def prune(args: argparse.Namespace) -> int:
    from ..resources import shipped_dir

    folder = _reference_folder(args.folder)
    if folder.resolve() == shipped_dir("reference_runs").resolve():
        raise GpuRegressError(f"{folder}: the references shipped with the plugin are not yours to prune")
    found = unread(folder, read_names(args.model, Path.cwd()) | set(args.keep))
    if not found:
        print(f"{folder}: every reference is read by a case")
        return 0
    for reference in found:
        print(f"{'deleted' if args.yes else 'unread'}: {reference.parent.name}/{reference.name}")
        if args.yes:  # the reference (<name>/<platform>), and its name's folder once no platform's is left
            shutil.rmtree(reference)
            if not any(reference.parent.iterdir()):
                reference.parent.rmdir()
    if not args.yes:
        again = "".join(f" --model={m}" for m in args.model) + "".join(f" --keep={k}" for k in args.keep)
        print(f"{len(found)} references no case reads; delete them with: gpuregress prune {folder} --yes{again}")
    return 0

