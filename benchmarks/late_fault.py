"""The smallest one-element error that starts late which the default suite catches (docs/envelope.md).

For each size, one element of every gradient reduce-scatter is off by that much from step ``--from-step``
(default 200 of 300) on: ``collective:op=reduce_scatter,mode=nudge,add=E,from_step=N`` (an absolute error E;
``--relative``: ``rel=E``, the element x (1 + E)). The
fsdp case and fsdp-resume are compared with the references in ``--refs`` in the tolerant lane (where every
real upgrade compares). Prints, per size, each case's verdict and the metrics that failed.

    python benchmarks/late_fault.py --refs reference_runs 1e-4 1e-5 1e-6 1e-7

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


def run(refs: Path, size: str, from_step: int, how: str) -> dict[str, tuple[str, list[str]]]:
    """Case -> (verdict, the failed metrics with their components) for one size of the fault."""
    fault = f"collective:op=reduce_scatter,mode=nudge,{how}={size},from_step={from_step}"
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
    parser.add_argument("sizes", nargs="+", help="sizes of the one-element error, e.g. 1e-5")
    parser.add_argument("--refs", type=Path, default=Path("reference_runs"))
    parser.add_argument("--from-step", type=int, default=200)
    parser.add_argument("--relative", action="store_true", help="the element x (1 + size), not + size")
    args = parser.parse_args()
    how = "rel" if args.relative else "add"
    shown = "x (1 + size)" if args.relative else "+ size"
    print(f"one element of every gradient reduce-scatter {shown} from step {args.from_step}, tolerant lane, "
          f"refs {args.refs}")
    for size in args.sizes:
        for case, (verdict, metrics) in sorted(run(args.refs, size, args.from_step, how).items()):
            print(f"{how} {size:>6}  {case:<12} {verdict:<7} {', '.join(metrics)}", flush=True)


if __name__ == "__main__":
    main()
