"""Measure the margin between legitimate drift and real faults for the fsdp scenario.

Runs the scenario clean, then under emulated legitimate changes (a different CPU kernel set,
a 1e-7 relative change in every linear layer) and under emulated faults, and prints for each
the largest deviation of every compared metric from the clean run. The tolerant lane's
fp32 defaults in pytest_gpuregress/reference/compare.py sit between the two groups.

    python benchmarks/noise_margin.py --steps 300
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.reference.compare import _rel
from pytest_gpuregress.reference.record import RunRecord

CASES: list[tuple[str, str, list[str], dict[str, str]]] = [
    ("legit", "ATEN_CPU_CAPABILITY=default (no SIMD)", [], {"ATEN_CPU_CAPABILITY": "default"}),
    ("legit", "linear x (1+1e-7)", ["linear_noise:rel=1e-7"], {}),
    ("fault", "1 elem of small reduce-scatters x (1+1e-4)",
     ["collective:op=reduce_scatter,max_bytes=200000,mode=nudge,rel=1e-4"], {}),
    ("fault", "1 elem of small reduce-scatters x (1+1e-3)",
     ["collective:op=reduce_scatter,max_bytes=200000,mode=nudge,rel=1e-3"], {}),
    ("fault", "every 4th all-gather stale chunk", ["collective:op=all_gather,mode=stale_chunk,every=4"], {}),
    ("fault", "lr x 1.01", ["lr_scale:factor=1.01"], {}),
]


def run(session: GpuRegressSession, faults: list[str], env: dict[str, str]) -> tuple[RunRecord, float]:
    t0 = time.monotonic()
    record = session.run("fsdp", faults=faults, env=env)
    return record, time.monotonic() - t0


def deviations(ref: RunRecord, got: RunRecord) -> dict[str, float]:
    out = {
        "loss": float(_rel(got.series["loss"], ref.series["loss"]).max()),
        "grad_norm": float(_rel(got.series["grad_norm"], ref.series["grad_norm"]).max()),
        "param_grad_norm": float(_rel(got.arrays["param_grad_norm"], ref.arrays["param_grad_norm"]).max()),
    }
    step0 = 0.0
    for key, r in ref.arrays.items():
        if key.startswith("step0_grad/"):
            g = got.arrays[key]
            step0 = max(step0, float(np.abs(g.astype(np.float64) - r).max() / np.abs(r).max()))
    out["step0_grad"] = step0
    out["final_weights"] = max(
        float(_rel(np.asarray(got.digests[n]["abs_sum"]), np.asarray(d["abs_sum"]))) for n, d in ref.digests.items()
    )
    first = np.nonzero(np.asarray(got.series["loss"]) != np.asarray(ref.series["loss"]))[0]
    out["first_loss_step"] = float(first[0]) if len(first) else -1.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    session = GpuRegressSession(Options(device="cpu", steps=args.steps, timeout=900), Path.cwd())
    clean, wall = run(session, [], {})
    print(f"clean run: {args.steps} steps in {wall:.1f}s, loss {clean.series['loss'][0]:.4f} -> "
          f"{clean.series['loss'][-1]:.4f}")
    metrics = ["loss", "grad_norm", "param_grad_norm", "step0_grad", "final_weights", "first_loss_step"]
    print(f"{'kind':<6} {'case':<46} " + " ".join(f"{m:>15}" for m in metrics))
    for kind, label, faults, env in CASES:
        got, _ = run(session, faults, env)
        dev = deviations(clean, got)
        print(f"{kind:<6} {label:<46} " + " ".join(f"{dev[m]:>15.3g}" for m in metrics), flush=True)


if __name__ == "__main__":
    main()
