"""Time the default collective sweep and print its bandwidth table, like nccl-tests.

    python benchmarks/collective_sweep.py                 # CPU default: 2 gloo ranks, up to 4 MiB
    python benchmarks/collective_sweep.py --max-bytes 256MiB --device cuda
"""

from __future__ import annotations

import argparse
import time

from pytest_gpuregress import collectives as plan
from pytest_gpuregress.launch.job import Job
from pytest_gpuregress.launch.spawn import SpawnLauncher
from pytest_gpuregress.platforms import resolve_platform
from pytest_gpuregress.scenarios import get_scenario
from pytest_gpuregress.sweep import parse_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-bytes", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="table rows for this dtype only (default: all)")
    args = parser.parse_args()
    platform = resolve_platform(args.device)
    scenario = get_scenario("collectives")
    config = scenario.default_config(platform.device_kind, None)
    max_bytes = parse_bytes(args.max_bytes) if args.max_bytes else config["max_bytes"]
    cases = plan.plan(platform.backend, platform.world_size, max_bytes)
    config.update(cases=[c.to_json() for c in cases], repeats=args.repeats)
    launcher = SpawnLauncher()
    job = Job(scenario="collectives", config=config, world_size=platform.world_size,
              device_kind=platform.device_kind, backend=platform.backend, run_dir=str(launcher.make_run_dir()),
              timeout_s=1800)
    started = time.monotonic()
    result = launcher.run(job, wall_timeout_s=1800)
    wall = time.monotonic() - started
    record = scenario.merge(result.records)
    failing = [c for c in cases if plan.verdict(c, record.results["cases"][c.id], platform.world_size)]
    for line in plan.bandwidth_table(cases, record.results["cases"], platform.world_size, args.dtype):
        print(line)
    print(f"\nsweep: {len(cases)} cases x {args.repeats} repeats up to {plan.human_bytes(max_bytes)} on "
          f"{platform.world_size} {platform.backend} ranks: {wall:.1f}s wall (start-up included), "
          f"{len(failing)} failing")


if __name__ == "__main__":
    main()
