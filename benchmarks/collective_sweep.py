"""Time the default collective sweep and print its bandwidth table, like nccl-tests.

    python benchmarks/collective_sweep.py                 # CPU default: 2 gloo ranks, up to 4 MiB
    python benchmarks/collective_sweep.py --max-bytes 256MiB --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.scenarios.collectives import DEFAULT_MAX_BYTES, plan
from pytest_gpuregress.units import human_bytes, parse_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-bytes", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="table rows for this dtype only (default: all)")
    args = parser.parse_args()
    session = GpuRegressSession(Options(device=args.device, timeout=1800), Path.cwd())
    platform = session.platform
    max_bytes = parse_bytes(args.max_bytes) if args.max_bytes else DEFAULT_MAX_BYTES[platform.device_kind]
    cases = plan.plan(platform.backend, platform.world_size, max_bytes)
    started = time.monotonic()
    record = session.run("collectives", config={"cases": [c.to_json() for c in cases], "repeats": args.repeats})
    wall = time.monotonic() - started
    results = record.results["cases"]
    failing = [c for c in cases if plan.problem(c, results[c.id], platform.world_size)]
    # An op this stack's backend lacks computed nothing: counted apart, never as failing.
    lacking = sorted({c.op_label for c in cases if plan.lacks_only(results[c.id])})
    unsupported = sum(plan.lacks_only(results[c.id]) for c in cases)
    for line in plan.bandwidth_table(cases, results, platform.world_size, args.dtype):
        print(line)
    print(f"\nsweep: {len(cases)} cases x {args.repeats} repeats up to {human_bytes(max_bytes)} on "
          f"{platform.world_size} {platform.backend} ranks: {wall:.1f}s wall (start-up included), "
          f"{len(failing)} failing, {unsupported} not supported"
          + (f" (this stack's {platform.backend} lacks {', '.join(lacking)})" if lacking else ""))


if __name__ == "__main__":
    main()
