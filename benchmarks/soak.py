"""Soak the launcher: how often does a run fail for reasons other than the numbers?

    python benchmarks/soak.py launches --runs 40     # the fsdp scenario, 3 steps, launcher only
    python benchmarks/soak.py pytest --runs 10       # the README's main job, end to end
    python benchmarks/soak.py raw --runs 30          # a plain 2-rank gloo FSDP2 script, no launcher

'launches' also counts ranks that died after delivering their results (teardown aborts the
launcher tolerates); 'raw' shows how often a bare script's rank dies at teardown on this machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

RAW_SCRIPT = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    rank, path = int(sys.argv[1]), sys.argv[2]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(20):
        model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    dist.destroy_process_group()
''')


def soak_launches(runs: int) -> None:
    from pytest_gpuregress.errors import RankFailure
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.plugin.session import GpuRegressSession

    session = GpuRegressSession(Options(device="cpu", steps=3, timeout=240), Path.cwd())
    failures, tolerated, started = 0, 0, time.monotonic()
    for i in range(runs):
        try:
            record = session.run("fsdp")
        except RankFailure as exc:
            failures += 1
            print(f"run {i}: FAILED\n{exc}")
            continue
        for note in record.notes:
            tolerated += 1
            print(f"run {i}: {note}")
    print(f"launches: {runs}, failed: {failures}, teardown deaths tolerated: {tolerated}, "
          f"{time.monotonic() - started:.0f}s")


def soak_pytest(runs: int, extra: list[str]) -> None:
    failures = 0
    for i in range(runs):
        done = subprocess.run([sys.executable, "-m", "pytest", "--gpuregress", "-p", "no:cacheprovider", *extra],
                              capture_output=True, text=True)
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        print(f"run {i}: exit {done.returncode}: {last}", flush=True)
        failures += done.returncode != 0
    print(f"pytest --gpuregress runs: {runs}, failed: {failures}")


def soak_raw(runs: int) -> None:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "raw.py")
        script.write_text(RAW_SCRIPT)
        for i in range(runs):
            store = Path(tmp, f"store{i}")
            procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store)], stderr=subprocess.PIPE)
                     for r in range(2)]
            codes = [p.wait() for p in procs]
            if any(codes):
                failures += 1
                print(f"run {i}: exit codes {codes}")
    print(f"raw script runs: {runs}, a rank died: {failures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["launches", "pytest", "raw"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for 'pytest' mode")
    args = parser.parse_args()
    {"launches": lambda: soak_launches(args.runs), "pytest": lambda: soak_pytest(args.runs, args.pytest_args),
     "raw": lambda: soak_raw(args.runs)}[args.mode]()


if __name__ == "__main__":
    main()
