"""``gpuregress inspect-fp8 FILE``: do a safetensors file's fp8 and fp4 codes mean what their tags say?

Runs the formats scenario's diagnosis (scenarios/formats/diagnose.py) on the file, read as safetensors only.
Exit 0 when clean, 1 on a finding, 2 when the file cannot be read or understood.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

METADATA_SHOWN = ("quantization", "element_format", "scale_format", "block_size", "scale_rule")


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("inspect-fp8", help="check the fp8/fp4 tensors of a safetensors file against their tags, "
                                                "metadata and scales; exit 1 on a finding")
    parser.add_argument("file", help="a .safetensors file")
    parser.add_argument("--all", action="store_true", help="one finding per tensor instead of one per kind")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..scenarios.formats import checkpoint, diagnose

    ckpt = checkpoint.read(Path(args.file))
    report = diagnose.diagnose(ckpt)
    shown = ", ".join(f"{k}={ckpt.metadata[k]}" for k in METADATA_SHOWN if k in ckpt.metadata) or "none"
    tags = ", ".join(f"{tag} x{count}" for tag, count in sorted(report.tags.items())) or "none"
    print(f"{report.path}: {report.tensors} quantized tensors ({tags}); metadata: {shown}")
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
