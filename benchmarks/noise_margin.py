"""Measure the noise envelope and where legitimate drift and real faults fall against it.

Runs the fsdp scenario clean, then its noise replicas (the envelope, as a recording stores it),
then emulated legitimate changes and emulated faults. For each it prints, per compared metric,
the largest deviation from the clean run and that deviation as a multiple of the replicas' spread
(at entries where the spread is not zero), plus the largest deviation where the spread is zero.
The envelope's K and floors (pytest_gpuregress/comparison/envelope.py) are chosen from this table:
legitimate rows must sit below K x spread + floor, fault rows well above.

    python benchmarks/noise_margin.py --steps 300
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pytest_gpuregress.comparison import envelope
from pytest_gpuregress.comparison.compare import compare_training
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.plugin.session import GpuRegressSession
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import Launch, get_scenario

CASES: list[tuple[str, str, list[str], dict[str, str]]] = [
    ("legit", "ATEN_CPU_CAPABILITY=default (no SIMD)", [], {"ATEN_CPU_CAPABILITY": "default"}),
    ("legit", "linear x (1+1e-7)", ["linear_noise:rel=1e-7"], {}),
    ("fault", "1 elem of small reduce-scatters x (1+1e-4)",
     ["collective:op=reduce_scatter,max_bytes=200000,mode=nudge,rel=1e-4"], {}),
    ("fault", "lr x 1.001", ["lr_scale:factor=1.001"], {}),
    ("fault", "lr x 1.01", ["lr_scale:factor=1.01"], {}),
]
METRICS = ("loss", "grad_norm", "param_grad_norm", "step0_grad", "final_weights")


def run(session: GpuRegressSession, faults: list[str], env: dict[str, str], config: dict | None = None) -> RunRecord:
    return session.run("fsdp", faults=faults, env=env, config=config)


def against(spread: dict[str, np.ndarray], base: RunRecord, got: RunRecord) -> dict[str, tuple[float, float, float]]:
    """metric -> (max deviation, max deviation / spread where spread > 0, max deviation where spread == 0)."""
    out = {}
    for metric, dev in envelope.deviations(base, got).items():
        s = spread[envelope.PREFIX + metric]
        moving = s > 0
        ratio = float((dev[moving] / s[moving]).max()) if moving.any() else 0.0
        still = float(dev[~moving].max()) if (~moving).any() else 0.0
        out[metric] = (float(dev.max()), ratio, still)
    return out


def _cell(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2g}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    session = GpuRegressSession(Options(device="cpu", steps=args.steps, timeout=900), Path.cwd())
    scenario = get_scenario("fsdp")
    t0 = time.monotonic()
    base = run(session, [], {})
    plain = time.monotonic() - t0
    launch = Launch("default", scenario.default_config(session.setup))
    replicas = scenario.noise_replicas(launch, session.setup, args.replicas)
    t0 = time.monotonic()
    spread = envelope.measure(base, [run(session, [], r.env, r.config) for r in replicas])
    print(f"clean run: {args.steps} steps in {plain:.1f}s; {len(replicas)} replicas in {time.monotonic() - t0:.1f}s "
          f"(recording = {1 + (time.monotonic() - t0) / plain:.1f}x a plain run)")
    print("replica spread, max per metric: " + ", ".join(
        f"{m} {float(spread[envelope.PREFIX + m].max()):.3g}" for m in METRICS if envelope.PREFIX + m in spread))
    print(f"\n{'kind':<6} {'case':<44} " + " ".join(f"{m:>28}" for m in METRICS))
    print(f"{'':<6} {'':<44} " + " ".join(f"{'max dev / x spread / at 0':>28}" for _ in METRICS))
    base.arrays.update(spread)
    for kind, label, faults, env in CASES:
        got = run(session, faults, env)
        dev = against(spread, base, got)
        verdict = "fails" if not compare_training(base, got, lane="tolerant").passed else "passes"
        cells = " ".join(f"{_cell(dev[m]) if m in dev else '-':>28}" for m in METRICS)
        print(f"{kind:<6} {label:<44} {cells}  tolerant lane: {verdict}", flush=True)


if __name__ == "__main__":
    main()
