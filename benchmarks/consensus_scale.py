"""The consensus vote at scale, simulated with CPU processes, and its 1,000-node estimate (docs/consensus.md).

    python benchmarks/consensus_scale.py                    # all four parts below
    python benchmarks/consensus_scale.py --parts devices,estimate --devices 32

Parts:
  devices    N spawned ranks of world size 1 as devices: pytest --gpuregress --gpuregress-consensus, timed
  nodes      A torchrun agents on 127.0.0.1 as nodes, P ranks each, the same run in place (the records cross by
             all-gather, as across real nodes)
  allgather  a gloo all-gather of one device's digests among N processes: the time per call, and how it grows
             with the message
  estimate   bytes per device, the all-gather of 1,000 nodes (ring: each node receives (N-1)/N of the total),
             and the session's vote over that many devices, timed on synthetic digests
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUMMARY = re.compile(r"consensus over (\d+) devices .*?(\d+) tensors a device, (\d+) bytes sent a device.*?"
                     r"slowest device ([\d.]+) s, launch ([\d.]+) s")


def pytest_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-consensus",
            "-k", "consensus-devices", *extra]


def summary_figures(output: str) -> dict[str, float]:
    found = SUMMARY.search(output)
    if found is None:
        raise SystemExit("no consensus summary in the output:\n" + output[-3000:])
    devices, tensors, sent, slowest, launch = found.groups()
    return {"devices": int(devices), "tensors": int(tensors), "bytes_per_device": int(sent),
            "slowest_device_s": float(slowest), "launch_s": float(launch)}


def spawned_devices(count: int) -> dict[str, Any]:
    """``count`` spawned ranks, each a device of world size 1; the saved record gives the transported sizes."""
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        done = subprocess.run(pytest_command(f"--gpuregress-world-size={count}", f"--gpuregress-artifacts={folder}"),
                              cwd=folder, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
        figures = {**summary_figures(done.stdout), "pytest_wall_s": wall}
        record = next(Path(folder).glob("consensus/*/devices/record.json"))
        figures.update(transported_sizes(json.loads(record.read_text())))
    return figures


def transported_sizes(merged: dict[str, Any]) -> dict[str, int]:
    """What the launcher moves per rank: its record's JSON (identity, key; rank 0 adds the tensor names and the
    stack fingerprint) and its arrays as safetensors (24 bytes a tensor). Rebuilt from the merged record, which
    carries every rank's part; timings and notes left out (a few hundred bytes)."""
    import numpy as np
    from safetensors.numpy import save

    from pytest_gpuregress.reference.record import RunRecord

    consensus = merged["results"]["consensus"]
    sizes = []
    for device in consensus["devices"]:
        own = {k: v for k, v in device.items() if k not in ("hashes", "sums", "magnitudes", "rank")}
        if device["rank"] == 0:
            own.update(names=consensus["names"], kinds=consensus["kinds"])
        record = RunRecord("consensus", merged["config"], "", len(consensus["devices"]), results={"consensus": own},
                           fingerprint=merged["fingerprint"] if device["rank"] == 0 else {})  # the worker's, rank 0
        arrays = {"h": np.zeros(len(device["hashes"]), np.uint64), "s": np.zeros((len(device["hashes"]), 2))}
        sizes.append(len(json.dumps(record.to_json()).encode()) + len(save(arrays)))
    return {"record_bytes_rank0": sizes[0], "record_bytes_other": max(sizes[1:] or sizes)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_nodes(agents: int, per_node: int) -> dict[str, Any]:
    """``agents`` torchrun agents on 127.0.0.1 as nodes of ``per_node`` devices each, run in place."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={agents}",
                                   f"--nproc-per-node={per_node}", f"--node-rank={node}", "--rdzv-backend=static",
                                   "--master-addr=127.0.0.1", f"--master-port={port}", *pytest_command()[1:]],
                                  cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for node in range(agents)]
        outputs = [p.communicate(timeout=1800)[0] for p in procs]
        wall = time.monotonic() - started
    return {**summary_figures(outputs[0]), "agents": agents, "torchrun_wall_s": wall}


def _gather_worker(rank: int, world: int, store_path: str, sizes: list[int], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    timings = {}
    for size in sizes:
        payload = torch.zeros(size, dtype=torch.uint8)
        chunks = [torch.empty_like(payload) for _ in range(world)]
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather(chunks, payload)
            seconds.append(time.perf_counter() - start)
        timings[size] = statistics.median(seconds)
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    dist.barrier()
    dist.destroy_process_group()


def allgather(world: int, per_device: int, repeats: int = 20) -> dict[str, Any]:
    """A gloo all-gather of ``per_device`` bytes (and 10x, 100x) among ``world`` processes on this machine."""
    import torch.multiprocessing as mp

    sizes = [per_device, 10 * per_device, 100 * per_device]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "timings.json")
        mp.spawn(_gather_worker, args=(world, os.path.join(folder, "store"), sizes, repeats, out), nprocs=world)
        timings = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    return {"world": world, "seconds_by_bytes": timings}


def estimate(per_device: int, tensors: int, nodes: int, gpus: int, alpha_us: float, gbps: float) -> dict[str, Any]:
    """The all-gather of every device's digests across ``nodes`` nodes, and the session's vote over them."""
    devices = nodes * gpus
    total = devices * per_device
    beta = gbps * 1e9 / 8  # bytes per second per node
    # Ring all-gather among node leaders after a gather inside each node (NVLink/xGMI, negligible here): N-1 steps
    # of one node's share each; every node receives (N-1)/N of the total.
    received = (nodes - 1) / nodes * total
    ring = (nodes - 1) * alpha_us * 1e-6 + received / beta
    flat = (devices - 1) * alpha_us * 1e-6 + (devices - 1) / devices * total / beta  # one rank per GPU in the ring
    return {"nodes": nodes, "devices": devices, "bytes_per_device": per_device, "total_bytes": total,
            "received_per_node": received, "ring_over_nodes_s": ring, "ring_over_gpus_s": flat,
            "vote_s": time_vote(devices, tensors)}


def time_vote(devices: int, tensors: int) -> float:
    """The session's vote (grouping, majority, the failure messages) over synthetic digests, two dissenters."""
    from pytest_gpuregress.scenarios.consensus import report
    from pytest_gpuregress.scenarios.consensus.vote import Device, vote

    key = {"device.kind": "cuda", "device.name": "GPU", "versions.torch": "2.13.0"}
    hashes = tuple(f"{i:016x}" for i in range(tensors))
    sums = tuple(float(i) for i in range(tensors))
    fleet = [Device(r, {"rank": r, "host": f"node{r // 8}", "node_rank": r // 8, "local_rank": r % 8,
                        "device": f"cuda:{r % 8}"}, key, "names", hashes if r not in (5, 97) else ("x", *hashes[1:]),
                    sums, sums) for r in range(devices)]
    started = time.perf_counter()
    result = vote(fleet, [f"train|0|t{i}" for i in range(tensors)], ["float32[8]"] * tensors)
    report.failures(result)
    report.table(result)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="devices,nodes,allgather,estimate")
    parser.add_argument("--devices", type=int, default=16, help="spawned devices (and all-gather processes)")
    parser.add_argument("--agents", type=int, default=4, help="torchrun agents, each one node")
    parser.add_argument("--per-node", type=int, default=4, help="ranks per torchrun agent")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes of the estimate")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node of the estimate")
    parser.add_argument("--alpha-us", type=float, default=20.0, help="latency of one inter-node message step, us")
    parser.add_argument("--gbps", type=float, default=100.0, help="inter-node bandwidth per node, Gb/s")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    per_device, tensors = 3600, 110  # replaced by the measured figures when the devices part runs
    if "devices" in parts:
        figures = spawned_devices(args.devices)
        per_device, tensors = figures["bytes_per_device"], figures["tensors"]
        print(f"devices: {figures['devices']} spawned CPU devices: launch {figures['launch_s']:.1f} s, pytest "
              f"{figures['pytest_wall_s']:.1f} s wall; slowest device's workload {figures['slowest_device_s']:.2f} s; "
              f"{tensors} tensors, {per_device} bytes of digests and identity per device; as transported: "
              f"{figures['record_bytes_other']} bytes a rank ({figures['record_bytes_rank0']} for rank 0, "
              "which adds the tensor names)")
    if "nodes" in parts:
        figures = torchrun_nodes(args.agents, args.per_node)
        print(f"nodes: {figures['agents']} torchrun agents x {args.per_node} ranks = {figures['devices']} devices in "
              f"place: launch {figures['launch_s']:.1f} s, {figures['torchrun_wall_s']:.1f} s wall")
    if "allgather" in parts:
        figures = allgather(args.devices, per_device)
        cells = ", ".join(f"{size} B: {seconds * 1e3:.2f} ms" for size, seconds in figures["seconds_by_bytes"].items())
        print(f"allgather: gloo over loopback among {figures['world']} processes, median per call: {cells}")
    if "estimate" in parts:
        e = estimate(per_device, tensors, args.nodes, args.gpus, args.alpha_us, args.gbps)
        print(f"estimate: {e['nodes']} nodes x {args.gpus} GPUs = {e['devices']} devices x {e['bytes_per_device']} B = "
              f"{e['total_bytes'] / 1e6:.1f} MB gathered; each node receives {e['received_per_node'] / 1e6:.1f} MB; "
              f"ring all-gather over node leaders (alpha {args.alpha_us:g} us, {args.gbps:g} Gb/s): "
              f"{e['ring_over_nodes_s'] * 1e3:.0f} ms; a ring over every GPU: {e['ring_over_gpus_s'] * 1e3:.0f} ms; "
              f"the session's vote over {e['devices']} devices: {e['vote_s']:.2f} s")


if __name__ == "__main__":
    main()
