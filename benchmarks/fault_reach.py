"""Which injected fault fires in which built-in case, measured: the fault x case table of docs/faults.md.

For each fault spec below, runs ``pytest --gpuregress`` once over a selection of every built-in
scenario (short runs, against an empty reference folder: only the firing counts matter here), reads
each case's JUnit properties and outcome, and prints one table row per spec:
  fires N     the fault acted N times in the case's launches (summed over ranks)
  0           the case ran with the fault and it fired zero times (the case failed saying so)
  skipped     the case was skipped for another reason (e.g. too few ranks)
  refused     the spec was refused for this run (a usage error)
Usage: python benchmarks/fault_reach.py [--steps 4] [--only SUBSTRING] [--markdown]
It takes about a minute per spec on 2 CPU cores; tests/faults/test_fault_reach.py checks the shipped table
against faults/reach.py, and the full tier runs a few rows of this matrix for real.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SELECTION = ("fsdp or lora or checkpoint or triage or formats or "
             "collectives-all_reduce-sum-fp32-n4096-outofplace or collectives-reduce_scatter-single-sum-fp32-n4096-outofplace")
SPECS = (
    "collective:op=all_reduce,mode=nudge",
    "collective:op=reduce_scatter,mode=nudge",
    "collective:op=all_gather,mode=nudge",
    "lr_scale", "linear_noise", "sdpa_backend", "host_op", "slow_step:seconds=0.01",
    "format:mode=fn_as_fnuz", "format:mode=keep_0x80", "format:mode=fnuz_max_448", "format:mode=flip_overflow",
    "format:mode=mx_scale_off_by_one", "format:mode=loader_fn_as_fnuz",
    "format:mode=loader_e5m2_as_e4m3fn",
    "lora:mode=grad_leak", "lora:mode=rank0_slice", "lora:mode=zero_lora_b", "lora:mode=merge_ulp",
    *(f"checkpoint:mode={m}" for m in ("optimizer_dropped", "rank0_shard", "chunks_permuted", "tied_key_dropped",
                                       "untied", "rng_not_restored", "weights_late", "ulp_nudge")),
)


def case_cells(junit: Path) -> dict[str, str]:
    """case id -> its cell, from one run's JUnit XML."""
    cells: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        case_id = name[name.find("[") + 1: -1] if "[" in name else name
        props = {p.get("name"): p.get("value", "") for p in case.iter("property")}
        failure = case.find("failure")
        text = (failure.get("message", "") + (failure.text or "")) if failure is not None else ""
        if case.find("skipped") is not None:
            cells[case_id] = "skipped"
        elif "fired 0 times" in text:
            cells[case_id] = "0"
        elif props.get("faults_fired"):
            counts = [int(part.rsplit(":", 1)[1]) for part in props["faults_fired"].strip("[]'\"").split("', '")
                      if ":" in part]
            cells[case_id] = f"fires {sum(counts)}" if sum(counts) else "0"
        else:
            cells[case_id] = "not counted"
    return cells


def measure(spec: str, steps: int, folder: Path) -> dict[str, str]:
    junit = folder / "junit.xml"
    refs = folder / "refs"
    refs.mkdir(exist_ok=True)
    # fault_reach_all declares every fault to reach every case: the run measures, it does not skip.
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "fault_reach_all", "-q", "--gpuregress",
               "-k", SELECTION,
               f"--gpuregress-steps={steps}", "--gpuregress-replicas=0", f"--gpuregress-reference-dir={refs}",
               f"--gpuregress-inject={spec}", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, check=False, env=env)
    if not junit.is_file():
        reason = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        return {"*": f"refused: {reason[0]}"}
    return case_cells(junit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default="", help="measure only the specs containing this text")
    args = parser.parse_args()
    rows: dict[str, dict[str, str]] = {}
    for spec in (s for s in SPECS if args.only in s):
        with tempfile.TemporaryDirectory(prefix="fault-reach-") as folder:
            rows[spec] = measure(spec, args.steps, Path(folder))
        print(f"{spec}: " + "; ".join(f"{case} {cell}" for case, cell in sorted(rows[spec].items())), flush=True)


if __name__ == "__main__":
    main()
