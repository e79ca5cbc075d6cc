"""Speed and size figures of the suite, against a bare training loop measured in the same run.

    python benchmarks/bench.py                  # everything below, in order
    python benchmarks/bench.py --only sizes     # one part: suite, bare, start, recording, profiling, sizes, gpu

Prints, and checks against the targets of issue #14 (printed, never asserted):
  suite      wall time of the default `pytest --gpuregress` and of each scenario in it
  bare       the yardstick: fsdp model, data and 300 steps on 2 gloo ranks, no plugin (bare_fsdp.py)
  start      time to start the ranks: a cold group, a warm (pooled) group, and fresh ranks per launch
  recording  the fsdp training loop with the plugin's recording against the bare loop: the ratio
  profiling  what the kernel inventory (one profiled step, one watched for host ops) costs each training
             scenario, as a share of its launch (target <= 5%, issue #15)
  sizes      the shipped references on disk; a GPU-size (110 M parameter) reference estimated from the
             model's shapes, and the time and memory one comparison at that size takes
  gpu        on a GPU: steps per second of the fsdp scenario and the collective bandwidth table
Targets: the suite within 5x the bare loop; recording within 5% of the bare loop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bare_fsdp import run_bare  # noqa: E402

from pytest_gpuregress.launch import template  # noqa: E402
from pytest_gpuregress.plugin.options import Options  # noqa: E402
from pytest_gpuregress.plugin.session import GpuRegressSession  # noqa: E402
from pytest_gpuregress.units import human_bytes  # noqa: E402

figures: dict[str, float] = {}


def suite() -> None:
    with tempfile.TemporaryDirectory(prefix="gpuregress-bench-") as tmp:
        junit = Path(tmp) / "junit.xml"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpuregress",
                               f"--junitxml={junit}"], cwd=ROOT, capture_output=True, text=True)
        figures["suite_s"] = time.monotonic() - started
        per_scenario: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for case in ET.parse(junit).iter("testcase"):
            scenario = case.get("name", "").split("[", 1)[-1].split("-", 1)[0].rstrip("]")
            per_scenario[scenario] += float(case.get("time", 0))
            counts[scenario] += 1
    print(f"default suite (pytest --gpuregress): {figures['suite_s']:.1f}s wall, exit code {done.returncode}")
    for scenario, seconds in sorted(per_scenario.items(), key=lambda kv: -kv[1]):
        print(f"    {scenario:<12} {seconds:7.1f}s  ({counts[scenario]} tests)")


def bare() -> None:
    result = run_bare(300, 2)
    figures["bare_wall_s"], figures["bare_train_s"] = result["wall_s"], result["train_s"]
    print(f"bare loop (fsdp model, 300 steps, 2 gloo ranks, no plugin): {result['wall_s']:.1f}s wall, "
          f"training loop {result['train_s']:.1f}s")


def _noop_launch(session: GpuRegressSession) -> float:
    started = time.monotonic()
    session.run("collectives", config={"cases": [], "repeats": 1})  # no cases: start, rendezvous, teardown
    return time.monotonic() - started


def start() -> None:
    pooled = GpuRegressSession(Options(enabled=True, device="cpu"), ROOT)
    fresh = GpuRegressSession(Options(enabled=True, device="cpu", fresh_ranks=True), ROOT)
    try:
        cold = _noop_launch(pooled)
        warm = min(_noop_launch(pooled) for _ in range(3))
        forked = min(_noop_launch(fresh) for _ in range(2))  # fresh ranks forked from the template
        os.environ[template.DISABLE] = "0"
        unpooled = min(_noop_launch(fresh) for _ in range(2))  # fresh ranks that import torch themselves
    finally:
        os.environ.pop(template.DISABLE, None)
        pooled.close()
        fresh.close()
    figures["start_cold_s"], figures["start_warm_s"] = cold, warm
    print(f"rank start-up per launch: pooled {warm:.2f}s warm ({cold:.1f}s for the session's first launch), "
          f"fresh ranks {forked:.2f}s forked from the template, {unpooled:.1f}s importing for themselves")


def recording() -> None:
    if "bare_train_s" not in figures:
        bare()
    session = GpuRegressSession(Options(enabled=True, device="cpu"), ROOT)
    try:
        record = session.run("fsdp")
    finally:
        session.close()
    train = record.timings["train_s"]
    ratio = train / figures["bare_train_s"]
    figures["recording_ratio"] = ratio
    print(f"training loop, 300 steps: with recording {train:.1f}s, bare {figures['bare_train_s']:.1f}s: "
          f"ratio {ratio:.3f} (target <= 1.05)")


def profiling() -> None:
    """What the kernel inventory costs each training scenario: the profiled and watched steps beyond two
    steady steps (measured inside the loop), against the scenario's whole launch."""
    session = GpuRegressSession(Options(enabled=True, device="cpu"), ROOT)
    try:
        session.run("fsdp", config={"steps": 3})  # start the ranks: a cold start is not profiling's
        for name in ("fsdp", "lora"):  # the training scenarios (checkpoint is a check scenario)
            record = session.run(name, config={"wrapper": "fsdp2"} if name == "lora" else None)
            cost, wall = record.results["perf"]["profiling_overhead_s"], record.timings["launch_wall_s"]
            print(f"profiling {name}: {cost:.3f}s of a {wall:.1f}s launch: {100 * cost / wall:.1f}% (target <= 5%)")
    finally:
        session.close()


def _gpu_shapes() -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_gpuregress.training.models import load_config

    config = load_config("tiny-llama", "gpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _gpu_size_record(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator, steps: int = 300):  # noqa: ANN202
    from pytest_gpuregress.evidence import step0
    from pytest_gpuregress.reference.record import RunRecord, float_digest

    arrays: dict[str, np.ndarray] = {"param_grad_norm": rng.uniform(0.1, 1, (steps, len(shapes)))}
    digests = {}
    for name, shape in shapes.items():
        grad = rng.standard_normal(shape, dtype=np.float32)
        arrays.update(step0.shard_arrays(name, grad, shape, 0, 1))
        digests[name] = float_digest(grad)
    return RunRecord(scenario="fsdp", config={"dtype": "bf16", "steps": steps}, platform_key="cuda-bench-w8-bf16",
                     world_size=8, series={"loss": list(rng.uniform(2, 5, steps)), "grad_norm": list(rng.uniform(0.5, 2, steps))},
                     param_names=list(shapes), arrays=arrays, digests=digests)


def sizes() -> None:
    from pytest_gpuregress.comparison.compare import compare_training

    print("shipped references on disk:")
    for folder in sorted((ROOT / "reference_runs").glob("*/*")):
        total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"    {folder.relative_to(ROOT / 'reference_runs')}: {human_bytes(total)}")
    shapes = _gpu_shapes()
    params = sum(int(np.prod(s)) for s in shapes.values())
    reference = _gpu_size_record(shapes, np.random.default_rng(0))
    run = _gpu_size_record(shapes, np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as tmp:
        reference.save(Path(tmp) / "ref")
        on_disk = sum(f.stat().st_size for f in (Path(tmp) / "ref").iterdir())
    figures["gpu_reference_bytes"] = on_disk
    print(f"GPU-size reference ({params / 1e6:.0f} M parameters, 300 steps): {human_bytes(on_disk)} on disk "
          f"(whole step-0 gradients would be {human_bytes(params * 4)}; target < 50 MB)")
    tracemalloc.start()
    started = time.monotonic()
    compare_training(reference, run, lane="tolerant")
    seconds = time.monotonic() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"comparing at GPU size: {seconds:.2f}s, peak {human_bytes(peak)} of Python memory")


def gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        print("gpu: no GPU visible; skipped")
        return
    session = GpuRegressSession(Options(enabled=True, device="cuda"), ROOT)
    try:
        record = session.run("fsdp")
    finally:
        session.close()
    print(f"fsdp on {session.platform.world_size} GPUs: {1 / record.timings['median_step_s']:.1f} steps/s "
          f"(median step {record.timings['median_step_s'] * 1e3:.1f} ms)")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "collective_sweep.py"), "--device", "cuda",
                    "--max-bytes", "256MiB", "--repeats", "1"], cwd=ROOT, check=False)


PARTS = {"suite": suite, "bare": bare, "start": start, "recording": recording, "profiling": profiling, "sizes": sizes,
         "gpu": gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(PARTS), action="append")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in args.only or list(PARTS):
        PARTS[name]()
    if "suite_s" in figures and "bare_wall_s" in figures:
        print(f"\nsuite / bare loop: {figures['suite_s'] / figures['bare_wall_s']:.1f}x (target <= 5x)")


if __name__ == "__main__":
    main()
