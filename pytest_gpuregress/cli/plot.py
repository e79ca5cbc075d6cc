"""``gpuregress plot REF [RUN]``: the failure report's figure, drawn from stored records."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("plot", help="draw the comparison plot of a reference and a run (needs "
                                         "pytest-gpuregress[plots])")
    parser.add_argument("reference", help="a reference folder (or a kept run's record)")
    parser.add_argument("run", nargs="?", help="a run to set against it; without it the reference and its band")
    parser.add_argument("-o", "--output", default="gpuregress-plot.png", help="PNG to write (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..reference.plot import plot_comparison
    from ..reference.store import load_record

    reference = load_record(Path(args.reference))
    other = load_record(Path(args.run)) if args.run else None
    path = plot_comparison(reference, other, Path(args.output), title=reference.scenario)
    print(f"plot: {path}")
    return 0
