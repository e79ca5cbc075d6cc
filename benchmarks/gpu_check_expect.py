"""What each step of gpu_check.sh must show, kept in one place that the script reads and the CPU tests check.

The one GPU run a task may get must not fail on its own expectations, so each expectation is written for
both modes here (``gpu``: CUDA or ROCm ranks; ``dry``: 2 gloo CPU ranks) and tests/test_gpu_check_expect.py
matches every ``gpu`` expectation against GPU-shaped output made by the plugin's own code (device kernel
names, host-op records, a cuda fingerprint). Where a fact lives in a record, the expectation reads the
structure (``sdpa-forced``, ``inventory``), never the report's wording: on a GPU an op's changed kernels are
listed device kernels first, and a report shows only the first changed ops.

    python3 benchmarks/gpu_check_expect.py text STEP MODE            prints the regex STEP's output must hold
    python3 benchmarks/gpu_check_expect.py sdpa-backend MODE         prints the backend the step forces
    python3 benchmarks/gpu_check_expect.py sdpa-forced MODE RECORD   exit 0 when RECORD's SDPA ran the forced backend
    python3 benchmarks/gpu_check_expect.py inventory MODE RECORD     exit 0 when RECORD's clean inventory is right
    python3 benchmarks/gpu_check_expect.py budget STEPS REPLICAS GPUS BUDGET_S   the GPU run's estimated time
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("gpu", "dry")
SDPA_OP = "aten::scaled_dot_product_attention"

# Regexes a step's output must contain (grep -E). One string serves both modes where the text is the plugin's
# or pytest's own wording, the same on every device; a pair differs only where the CPU really behaves otherwise.
TEXT: dict[str, dict[str, str]] = {
    "env": {"gpu": '"kind": "cuda"', "dry": '"kind": "cpu"'},  # ROCm builds are torch.cuda devices too
    "platform-key": {"gpu": "^(cuda|rocm)-", "dry": "^cpu-"},
    # The recording and triage's two cases; at one rank the equivalence needs peers and is skipped.
    "record": {mode: "(^|[^0-9])3 passed" for mode in MODES} | {"gpu-w1": "(^|[^0-9])2 passed, 1 skipped"},
    "compare": {mode: r"PASSED \[exact lane\]" for mode in MODES},
    # That the forced backend failed the run on a kernel change; which kernel is read from the kept record.
    "sdpa-backend": {mode: "kernels changed since the reference" for mode in MODES},
    "host-op": {mode: "ran on the CPU.*aten::silu" for mode in MODES},
    # gloo has no protocols: the CPU sweep runs once and says so; a one-GPU sweep skips every case.
    "protocols": {"gpu": "protocol LL128: ", "gpu-w1": " skipped", "dry": "does not apply to gloo"},
    "collective-fault": {mode: "wrong elements" for mode in MODES} | {
        "gpu-w1": "gpuregress-inject: .collective:.*needs 2 or more ranks to fire"},
    "sweep-bench": {mode: " 0 failing" for mode in MODES},
}

# The SDPA backend the sdpa-backend step forces, and the aten op it dispatches to: one the clean run does not use.
# GPUs run math (stack/determinism.py routes them there), so flash is forced; the CPU runs its own flash kernel,
# so math is forced.
SDPA_FORCED: dict[str, tuple[str, str]] = {
    "gpu": ("flash", r"^aten::_scaled_dot_product_flash_attention$"),
    "dry": ("math", r"^aten::_scaled_dot_product_attention_math$"),
}
# What the clean reference's inventory holds: the math SDPA and an empty host-op watch on GPUs; on the CPU its
# flash kernel and no host-op watch at all (there is no host to fall back to).
SDPA_CLEAN = {"gpu": r"^aten::_scaled_dot_product_attention_math$", "dry": r"^aten::_scaled_dot_product_flash_attention_for_cpu$"}
HOST_OPS_CLEAN: dict[str, dict[str, Any] | None] = {"gpu": {}, "dry": None}


# --- the GPU budget, estimated from what each step launches -------------------------------------------------------

# The cost of one launch on the GPU machine, each an input printed with the estimate. Model build and initial
# weights: benchmarks/init_cost.py at GPU size on this project's 2-core machine (the GPU host has 16 cores, so
# they are upper bounds there); the first launch computes and caches the initial weights, later ones read them.
# The rest are assumptions until a GPU has run this, each from a count: a rank's start (Python, torch,
# transformers, the NCCL communicator); step 0's op trace and the profiled inventory steps of a model launch; a
# training step of the GPU model on one H200 (6 x 156 M parameters x 12,288 tokens = 11.5 TFLOP in bf16, at a
# third of the chip's 790 TFLOP/s, with math attention); the float64 oracle's step 0 on the host (11.5 TFLOP in
# float64 on 16 cores, about 0.3 TFLOP/s); one NCCL sweep launch up to 64 MiB. Step 0's op trace digests each op's
# outputs where they live (evidence/tensor_digest.py): on the GPU, about 1,100 outputs of up to 35 M bf16 elements
# (an MLP activation of 12,288 tokens x 2,816), each read once at a few TB/s, under a second a launch; counted at
# 8 s, as if a quarter of them were read at host speed (1.1 s per 35 M bf16 elements on one thread, measured here).
# Launches that trace step 0: the recording's own run (not its replicas), the comparing runs, and the host-op run;
# triage's experiments and the oracle trace nothing.
COSTS_S = {"session": 10.0, "rank_start": 10.0, "build_first": 8.0, "build_later": 1.5, "trace_and_profile": 10.0,
           "trace_digests": 8.0, "train_step": 0.15, "host_step": 3.0, "oracle": 45.0, "collective_launch": 30.0,
           "process": 6.0}


@dataclass(frozen=True)
class Launches:
    """What one step of gpu_check.sh starts on the GPU machine."""

    sessions: int = 0  # pytest sessions: the interpreter, torch and transformers, the fingerprint, collection
    models: int = 0  # rank groups that build the GPU-size model and train it
    traced: int = 0  # of those, the groups that trace step 0 (its digests)
    steps: int = 0  # training steps, summed over those groups
    host_steps: int = 0  # training steps with an op moved to the host (the host-op fault): seconds each
    oracles: int = 0  # float64 oracle launches: step 0 of the GPU model on the host
    sweeps: int = 0  # rank groups that run the collective sweep (no model)
    processes: int = 0  # plain processes (the fingerprint, the key, the record checks, the sweep benchmark)

    def seconds(self, first_build: bool) -> float:
        builds = self.models + self.oracles
        build = (COSTS_S["build_first"] + (builds - 1) * COSTS_S["build_later"]) if first_build and builds \
            else builds * COSTS_S["build_later"]
        return (self.sessions * COSTS_S["session"] + self.models * (COSTS_S["rank_start"] + COSTS_S["trace_and_profile"])
                + self.traced * COSTS_S["trace_digests"] + build + self.steps * COSTS_S["train_step"]
                + self.host_steps * COSTS_S["host_step"]
                + self.oracles * (COSTS_S["rank_start"] + COSTS_S["oracle"])
                + self.sweeps * COSTS_S["collective_launch"] + self.processes * COSTS_S["process"])


def gpu_launches(steps: int, replicas: int, one_gpu: bool, triage_steps: int = 3) -> dict[str, Launches]:
    """Each step's launches on the GPU, in the script's order (its comments say why each is there)."""
    peers = 0 if one_gpu else 1  # what needs 2+ ranks is skipped on one GPU
    return {
        "env": Launches(processes=1),
        "platform-key": Launches(processes=1),
        # the run, its noise replicas, the float64 oracle a recording is judged by, and triage's experiments beside
        # them: one rank for a few steps and that same oracle; N ranks too where there are peers (triage/__init__.py)
        "record": Launches(sessions=1, models=1 + replicas + 1 + peers, traced=1,
                           steps=(1 + replicas) * steps + (1 + peers) * triage_steps, oracles=1),
        "reference-at-key": Launches(),
        "compare": Launches(sessions=1, models=1, traced=1, steps=steps),
        "sdpa-backend": Launches(sessions=1, models=1, traced=1, steps=steps),
        "sdpa-forced": Launches(processes=1),
        # a 4-step recording with silu on the host: it fails its own checks, so no oracle is asked
        "host-op": Launches(sessions=1, models=1, traced=1, host_steps=4),
        "inventory": Launches(processes=1),
        "protocols": Launches(sessions=1, sweeps=3 * peers),  # one launch per NCCL protocol; skipped on one GPU
        "collective-fault": Launches(sessions=1, sweeps=peers),  # on one GPU a usage error, before any launch
        "sweep-bench": Launches(processes=peers),
    }


def budget_lines(steps: int, replicas: int, one_gpu: bool, budget_s: int) -> tuple[list[str], bool]:
    """The estimate, a line per step, and whether it fits ``budget_s``."""
    lines, total, first = [], 0.0, True
    for step, launched in gpu_launches(steps, replicas, one_gpu).items():
        seconds = launched.seconds(first)
        first = first and not (launched.models or launched.oracles)
        total += seconds
        lines.append(f"  {step:<17} {launched.sessions} pytest, {launched.models} model launches, "
                     f"{launched.steps + launched.host_steps:>4} steps, {launched.oracles} oracle, "
                     f"{launched.sweeps} sweeps: {seconds:4.0f} s")
    fits = total <= budget_s
    head = (f"GPU budget estimate ({'one GPU' if one_gpu else '2+ GPUs'}, {steps} steps, {replicas} replicas): "
            f"{total:.0f} s of the {budget_s} s budget{'' if fits else ' - OVER BUDGET'}")
    costs = ", ".join(f"{name} {value:g} s" for name, value in COSTS_S.items())
    return [head, *lines, f"  per-launch costs assumed: {costs} (benchmarks/gpu_check_expect.py)"], fits


def text(step: str, mode: str) -> str:
    """The regex ``step``'s output must hold in ``mode`` ("gpu-w1" falls back to "gpu" where it says nothing else)."""
    by_mode = TEXT[step]
    return by_mode.get(mode) or by_mode[mode.removesuffix("-w1")]


def sdpa_dispatch(results: dict[str, Any]) -> list[str]:
    """The aten ops SDPA dispatched to in a record's kernel inventory (empty when it has none)."""
    entry = (results.get("kernels") or {}).get(SDPA_OP) or {}
    return list(entry.get("dispatch") or [])


def sdpa_forced_problems(results: dict[str, Any], mode: str) -> list[str]:
    """Why a run under the forced backend did not dispatch SDPA to it; empty when it did."""
    pattern = SDPA_FORCED[_base(mode)][1]
    dispatch = sdpa_dispatch(results)
    if any(re.search(pattern, op) for op in dispatch):
        return []
    return [f"{SDPA_OP} dispatched to {dispatch or 'nothing recorded'}, not /{pattern}/"]


def inventory_problems(results: dict[str, Any], mode: str) -> list[str]:
    """Why a clean reference's kernel inventory is not what this mode runs; empty when it is."""
    problems = []
    dispatch = sdpa_dispatch(results)
    if not any(re.search(SDPA_CLEAN[_base(mode)], op) for op in dispatch):
        problems.append(f"{SDPA_OP} dispatched to {dispatch or 'nothing recorded'}, not /{SDPA_CLEAN[_base(mode)]}/")
    host = results.get("host_ops")
    host_ops = host.get("ops") if isinstance(host, dict) else None
    if host_ops != HOST_OPS_CLEAN[_base(mode)]:
        problems.append(f"host ops {json.dumps(host_ops)}, expected {json.dumps(HOST_OPS_CLEAN[_base(mode)])}")
    return problems


def _base(mode: str) -> str:
    if mode.removesuffix("-w1") not in MODES:
        raise SystemExit(f"gpu_check_expect: mode {mode!r} is not one of {', '.join(MODES)} (or gpu-w1)")
    return mode.removesuffix("-w1")


def _results(path: str) -> dict[str, Any]:
    record = Path(path)
    if not record.is_file():
        raise SystemExit(f"gpu_check_expect: no record at {record}")
    return json.loads(record.read_text())["results"]


def main(argv: list[str]) -> int:
    match argv:
        case ["text", step, mode]:
            print(text(step, mode))
            return 0
        case ["sdpa-backend", mode]:
            print(SDPA_FORCED[_base(mode)][0])
            return 0
        case ["budget", steps, replicas, gpus, budget_s]:
            lines, fits = budget_lines(int(steps), int(replicas), int(gpus) == 1, int(budget_s))
            print("\n".join(lines))
            return 0 if fits else 1
        case ["sdpa-forced" | "inventory" as check, mode, record]:
            results = _results(record)
            problems = (sdpa_forced_problems if check == "sdpa-forced" else inventory_problems)(results, mode)
            print(json.dumps({"sdpa_dispatch": sdpa_dispatch(results), "host_ops": results.get("host_ops"),
                              "perf": results.get("perf"), "problems": problems}, indent=1))
            return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
