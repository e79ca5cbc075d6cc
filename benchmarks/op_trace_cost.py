"""What the step-0 op trace costs: its size in a record and the time it adds, measured on the CPU model, and the
figures for the 156 M-parameter GPU model, from its structure run on the CPU (docs/triage.md quotes both).

Each rank runs the fsdp scenario's step 0 (training/loop.py ``take_step``: FSDP2, AdamW, clipping) on a fresh
model, untraced and traced with each backend, alternately, ``--repeats`` times; the median times are compared.

    python benchmarks/op_trace_cost.py                  # the CPU model, 2 gloo ranks: about a minute
    python benchmarks/op_trace_cost.py --gpu-structure  # also the GPU model's 8 layers and widths, 2 short batches

For the GPU model the op count and the trace's size do not depend on the batch or the device (the same ops run
per layer); the digests' cost does: on a GPU they are ~8 small kernels and one synchronisation per output plus
about six passes over its bytes, so the estimate is  ops x (measured per-op host overhead + 60 us) + 6 x output
bytes / 4 TB/s, the bytes extrapolated to the GPU batch (6 x 256 tokens per rank) from two short batches.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "b8": 1}
BACKENDS = ("DebugMode", "TorchDispatchMode")
GPU_TOKENS_PER_RANK = 6 * 256  # the GPU config: global batch 48 over 8 ranks, 256 tokens each
GPU_RANKS = 8


def output_bytes(shapes: list[str]) -> int:
    total = 0
    for text in shapes:
        found = re.match(r"([a-z0-9]+)\[(.*)\]$", text)
        if found:
            dims = [int(d) for d in found.group(2).split(",") if d.strip()]
            count = 1
            for d in dims:
                count *= d
            total += count * BYTES.get(found.group(1), 4)
    return total


def step0(size: str, batch: int, seq: int, backend: str | None, rank: int, world: int) -> dict[str, Any]:
    """Step 0 of a fresh model of ``size``; traced with ``backend`` (None: untraced). Seconds, and the trace."""
    import torch

    from pytest_gpuregress.evidence.op_tracer import OpTracer
    from pytest_gpuregress.training.fsdp2 import shard, shard_units
    from pytest_gpuregress.training.loop import TrainStep, clip_gradients, take_step
    from pytest_gpuregress.training.models import blueprint, build_causal_lm
    from pytest_gpuregress.training.optimizer import AdamWSettings, Optimization, Schedule, adamw
    from pytest_gpuregress.training.step import next_token_loss

    model = build_causal_lm(blueprint({"model": "tiny-llama", "model_size": size, "dtype": "fp32"}), seed=0)
    shard(shard_units(model))
    params = list(model.parameters())
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    tracer = OpTracer(rank, model, backend=backend) if backend else None
    step = TrainStep(loss=lambda s: next_token_loss(model, tokens),
                     optimization=Optimization.of(adamw(params, AdamWSettings(3e-3, (0.9, 0.95), 1e-8, 0.1)),
                                                  Schedule(10, 2, 0.1)),
                     clip=lambda: clip_gradients(params, 1.0), tracked=params, op_trace=tracer)
    torch.distributed.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    take_step(step, 0, SimpleNamespace(world_size=world, device="cpu"))  # a rank's context: what the step reads
    # CPU time too: on a shared machine the wall time of a step says as much of the neighbours as of the trace.
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if tracer is None:
        return {"seconds": seconds, "cpu": cpu}
    trace = tracer.trace()
    entries = [trace.entry(i) for i in range(len(trace))]
    # This rank's shards: what clipping and the optimizer work on, and the weights read as inputs.
    sharded = [e for e in entries if e.phase in ("clip", "optimizer") or e.op == "<input>"]
    return {"seconds": seconds, "cpu": cpu, "ops": len(trace), "bytes": trace.nbytes(), "strings": len(trace.strings),
            "outputs": sum(len(e.outputs) for e in entries),
            "sharded_bytes": output_bytes([s for e in sharded for s in e.outputs]),
            "output_bytes": output_bytes([s for e in entries if e not in sharded for s in e.outputs])}


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the scenarios' ranks run
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    runs = [("cpu", 8, 64)] + ([("gpu", 1, 32), ("gpu", 2, 32)] if args.gpu_structure else [])
    for size, batch, seq in runs:
        key = f"{size}-{batch}x{seq}"
        repeats = args.repeats if size == "cpu" else 1
        # The GPU structure's ops and bytes; its time on this CPU says nothing of a GPU's.
        backends = (None, *BACKENDS) if size == "cpu" else ("DebugMode",)
        for _ in range(repeats):
            for backend in backends:
                row = step0(size, batch, seq, backend, rank, world)
                results.setdefault(key, {}).setdefault(backend or "untraced", []).append(row)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def summarize(results: dict[str, Any]) -> list[str]:
    lines = []
    for key, by_backend in results.items():
        if "untraced" not in by_backend:
            continue
        base = statistics.median(r["seconds"] for r in by_backend["untraced"])
        base_cpu = statistics.median(r["cpu"] for r in by_backend["untraced"])
        lines.append(f"{key}: step 0 untraced {base:.3f} s wall, {base_cpu:.3f} s CPU (medians)")
        for backend in BACKENDS:
            rows = by_backend[backend]
            traced = statistics.median(r["seconds"] for r in rows)
            traced_cpu = statistics.median(r["cpu"] for r in rows)
            row = rows[0]
            per_op = (traced_cpu - base_cpu) / row["ops"] * 1e6
            digested = (row["output_bytes"] + row["sharded_bytes"]) / 2**20
            lines.append(f"  {backend}: {row['ops']} ops, {row['outputs']} outputs, {row['strings']} strings, "
                         f"trace {row['bytes'] / 1024:.1f} KiB per rank; step 0 {traced:.3f} s wall "
                         f"(+{traced - base:.3f} s), {traced_cpu:.3f} s CPU (+{traced_cpu - base_cpu:.3f} s, "
                         f"{per_op:.0f} us per op); outputs digested {digested:.1f} MiB")
    return lines


def gpu_estimate(results: dict[str, Any]) -> list[str]:
    small, large = results["gpu-1x32"]["DebugMode"][0], results["gpu-2x32"]["DebugMode"][0]
    cpu = results["cpu-8x64"]
    base = statistics.median(r["cpu"] for r in cpu["untraced"])
    per_op = (statistics.median(r["cpu"] for r in cpu["DebugMode"]) - base) / cpu["DebugMode"][0]["ops"]
    per_token = (large["output_bytes"] - small["output_bytes"]) / 32
    fixed = small["output_bytes"] - per_token * 32
    # Activations scale with the tokens; at 8 ranks the shards are a quarter of those at the 2 measured here.
    gpu_bytes = fixed + per_token * GPU_TOKENS_PER_RANK + small["sharded_bytes"] * 2 / GPU_RANKS
    seconds = small["ops"] * (per_op + 60e-6) + 6 * gpu_bytes / 4e12
    return [f"GPU model (156 M parameters, 8 layers, {GPU_RANKS} ranks, {GPU_TOKENS_PER_RANK} tokens per rank), estimated:",
            f"  {small['ops']} ops per rank, trace {small['bytes'] / 1024:.0f} KiB per rank, "
            f"{GPU_RANKS * small['bytes'] / 2**20:.1f} MiB per reference ({GPU_RANKS} ranks)",
            f"  outputs digested about {gpu_bytes / 2**30:.1f} GiB per rank; "
            f"added to step 0 about {seconds:.2f} s ({per_op * 1e6:.0f} us host overhead per op, measured on this CPU)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-structure", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(rank_main, args=(2, store, args, tmp), nprocs=2)
        results = json.loads(Path(tmp, "rank0.json").read_text())
    for line in summarize(results) + (gpu_estimate(results) if args.gpu_structure else []):
        print(line)


if __name__ == "__main__":
    main()
