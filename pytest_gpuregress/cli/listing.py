"""``gpuregress list FOLDER``: the references a folder holds, by scenario and platform, with when and on what
stack each was recorded. Reads each reference's two JSON files only; a damaged one is listed as such."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import GpuRegressError

MANIFEST = "manifest.json"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("list", help="list the references a folder holds, with the stack that recorded each")
    parser.add_argument("folder", help="a reference folder (--gpuregress-reference-dir; the shipped reference_runs/)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise GpuRegressError(f"{folder}: no such folder; give the folder references are recorded in "
                              "(--gpuregress-reference-dir)")
    rows = [_row(manifest.parent) for manifest in sorted(folder.glob(f"*/*/{MANIFEST}"))]
    if not rows:
        print(f"{folder}: holds no reference")
        return 0
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER))]
    for row in [HEADER, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


HEADER = ("scenario", "platform", "recorded", "steps", "stack")


def _row(reference: Path) -> tuple[str, ...]:
    try:
        manifest = json.loads((reference / MANIFEST).read_text())
        record = json.loads((reference / "record.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return (reference.parent.name, reference.name, "-", "-", f"damaged: {type(exc).__name__}")
    fingerprint = record.get("fingerprint", {}) if isinstance(record, dict) else {}
    versions, device = fingerprint.get("versions", {}), fingerprint.get("device", {})
    cpu = device.get("kind") == "cpu"
    where = (f"{device.get('cpu_model')} [{device.get('cpu_capability')}]" if cpu else device.get("name")) or "?"
    stack = f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}; {where}"
    steps = len(record.get("series", {}).get("loss", [])) if isinstance(record, dict) else 0
    return (reference.parent.name, reference.name, str(manifest.get("recorded_at", "?"))[:16].replace("T", " "),
            str(steps or "-"), stack)
