"""The smallest one-element error that starts late which the default suite catches (docs/envelope.md).

For each size, one element of every gradient reduce-scatter is off by that relative amount from step
``--from-step`` (default 200 of 300) on: ``collective:op=reduce_scatter,mode=nudge,rel=R,from_step=N``. The
fsdp case and fsdp-resume are compared with the references in ``--refs`` in the tolerant lane (where every
real upgrade compares). Prints, per size, each case's verdict and the metrics that failed.

    python benchmarks/late_fault.py --refs reference_runs 1e-3 1e-4 1e-5 1e-6

Run it against references recorded before the late gradients (resume at step 150, no ``late_grad``) for the
"before" column, and against ones recorded with them for "after". CPU: about 80 s per size on two cores.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

LINE = re.compile(r"^(fsdp(?:-resume)?) cpu-\S+: (PASSED|FAILED) \[(\w+) lane\]")
FINDING = re.compile(r"^\[([^\]]+)\] (?:resumed at step \d+ \(steps counted from there\): )?(\w+)")


def run(refs: Path, rel: str, from_step: int) -> dict[str, tuple[str, list[str]]]:
    """Case -> (verdict, the failed metrics with their components) for one size of the fault."""
    fault = f"collective:op=reduce_scatter,mode=nudge,rel={rel},from_step={from_step}"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "-q",
           f"--gpuregress-reference-dir={refs}", "--gpuregress-lane=tolerant", f"--gpuregress-inject={fault}",
           "-k", "fsdp and not bf16 and not triage"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800).stdout
    verdicts = {m.group(1): (m.group(2), []) for m in map(LINE.match, out.splitlines()) if m}
    # Each failed test prints its findings in a section of its own, in the order of the summary lines.
    sections = out.split("gpuregress regression:")[1:]
    failed = [case for case, (verdict, _) in verdicts.items() if verdict == "FAILED"]
    for case, section in zip(failed, sections):
        metrics = sorted({f"{m.group(2)} [{m.group(1)}]" for m in map(FINDING.match, section.splitlines()) if m})
        verdicts[case] = ("FAILED", metrics)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="+", help="relative sizes of the one-element error, e.g. 1e-4")
    parser.add_argument("--refs", type=Path, default=Path("reference_runs"))
    parser.add_argument("--from-step", type=int, default=200)
    args = parser.parse_args()
    print(f"one element of every reduce-scatter x (1 + rel) from step {args.from_step}, tolerant lane, refs {args.refs}")
    for rel in args.sizes:
        for case, (verdict, metrics) in sorted(run(args.refs, rel, args.from_step).items()):
            print(f"rel {rel:>6}  {case:<12} {verdict:<7} {', '.join(metrics)}", flush=True)


if __name__ == "__main__":
    main()
