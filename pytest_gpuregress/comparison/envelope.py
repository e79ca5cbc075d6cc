"""The noise envelope: how far a healthy stack's legitimate perturbations move each metric. numpy only.

``measure`` turns the record-time replicas' deviations (training/noise.py) into per-step spreads stored as
``envelope/<metric>``; the tolerant lane allows ``K x spread + floor`` (``limit``). It uses the comparison's own
``deviations``, so the envelope and the check never disagree on what is measured. See docs/envelope.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GpuRegressError
from ..evidence import step0
from ..reference import by_name
from ..reference.record import RunRecord


class NoisyReplica(GpuRegressError):
    """A noise replica went non-finite: no envelope can be measured from it."""

PREFIX = "envelope/"

# K and the floors from benchmarks/noise_margin.py (docs/envelope.md, "How K was chosen"): K = 10 sits 3x to 6x
# above the worst legitimate change (1.7x the replicas' spread) and 6x below the weakest caught fault (63x).
K = 10.0


# The per-step series a training record keeps, each compared step by step: the loss, the global gradient norm
# before clipping, and after it (where a clip that scales wrongly, or not at all, shows while the gradients
# before it are right).
SERIES = ("loss", "grad_norm", "clipped_grad_norm")
PER_STEP = (*SERIES, "param_grad_norm")  # metrics stored one row per step
# The final weights' magnitudes (each tensor's sum of |w|) have an envelope of their own: chaos moves the signed sums
# by about its elementwise spread but the sum of |w| by far less, while a systematic change (a weight decay skipped)
# moves it first. Where a reference keeps no such envelope, magnitudes are held to final_weights' limit (``limit``).
MAGNITUDE = "weight_magnitude"
METRICS = (*PER_STEP, "step0_grad", "final_weights", MAGNITUDE)  # every metric a training comparison judges


@dataclass(frozen=True)
class MetricLimits:
    """One limit per compared metric: relative for scalars; for tensors, |a-b| / max|reference|."""

    loss: float
    grad_norm: float
    param_grad_norm: float
    step0_grad: float
    final_weights: float
    clipped_grad_norm: float | None = None  # None: grad_norm's (the same quantity, after clipping)
    weight_magnitude: float | None = None  # None: final_weights' (a part of what that metric measures)

    def of(self, metric: str) -> float:
        value = getattr(self, metric)
        return self.of(SHARES_LIMIT[metric]) if value is None else float(value)


SHARES_LIMIT = {"clipped_grad_norm": "grad_norm", MAGNITUDE: "final_weights"}  # a metric without a limit of its own


# fp32: two float32 ulps (2.4e-7 relative): a floor that covers rounding, and stays 50x below the
# weakest fault above. bf16: one bf16 ulp (2^-8), not yet measured on a GPU.
# The floors: the smallest allowed deviation per metric, for entries where no replica moved at all.
FLOORS: dict[str, MetricLimits] = {
    "fp32": MetricLimits(loss=2.5e-7, grad_norm=2.5e-7, param_grad_norm=2.5e-7, step0_grad=2.5e-7, final_weights=2.5e-7),
    "bf16": MetricLimits(loss=4e-3, grad_norm=4e-3, param_grad_norm=4e-3, step0_grad=4e-3, final_weights=4e-3),
}


def floors_for(dtype: str) -> MetricLimits:
    return FLOORS.get(dtype, FLOORS["bf16"])


def rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| / |b| elementwise in float64; a NaN on one side only is an infinite deviation."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny)
    return np.where(np.isnan(a) != np.isnan(b), np.inf, np.nan_to_num(out, nan=0.0, posinf=np.inf))


def magnitude_deviation(run: dict, ref: dict) -> float:
    """How far a final weight's magnitude moved: its sum of |w|, relative."""
    return float(rel(np.asarray(run["abs_sum"]), np.asarray(ref["abs_sum"])))


def digest_deviation(run: dict, ref: dict) -> float:
    """How far final-weight digests moved: magnitude (abs_sum), sign (sum) and arrangement (signed_dot). Signed sums
    are measured against the tensor's L2 norm, not its |sum|: a flipped sign moves them by about 2 x ||w||, which
    stays visible however large the tensor (|sum| grows like n, ||w|| like sqrt(n))."""
    magnitude = magnitude_deviation(run, ref)
    scale = max(abs(float(ref["l2"])), float(np.finfo(np.float64).tiny))
    signed = [abs(float(run[k]) - float(ref[k])) / scale for k in ("sum", "signed_dot") if k in run and k in ref]
    value = max([magnitude, *signed])
    return float("inf") if np.isnan(value) else value


def deviations(reference: RunRecord, run: RunRecord) -> dict[str, np.ndarray]:
    """Per-metric deviation arrays of ``run`` from ``reference``, in the comparison's measures; a metric missing or
    shaped otherwise on either side has none (the comparison reports it)."""
    pairs = {metric: (reference.series.get(metric), run.series.get(metric)) for metric in SERIES}
    pairs["param_grad_norm"] = (reference.arrays.get("param_grad_norm"), by_name.param_grad_norms(reference, run)[0])
    found = {metric: _relative(ref, got) for metric, (ref, got) in pairs.items()}
    found["step0_grad"] = _step0_largest(reference, run)
    found["final_weights"] = _digest_deviations(reference, run)
    found[MAGNITUDE] = _digest_deviations(reference, run, magnitude_deviation)
    return {metric: dev for metric, dev in found.items() if dev is not None}


def _relative(ref: Any, got: Any) -> np.ndarray | None:
    """``rel`` where both sides hold the metric, shaped alike."""
    return rel(got, ref) if ref is not None and got is not None and np.shape(ref) == np.shape(got) else None


def _step0_largest(reference: RunRecord, run: RunRecord) -> np.ndarray | None:
    """Each step-0 gradient's largest deviation; None where one is missing or reshaped."""
    per_tensor = [step0.step0_deviation(run, reference, n) for n in step0.names(reference)]
    if not per_tensor or any(d is None for d in per_tensor):
        return None
    return np.asarray([float(d.max()) if d.size else 0.0 for d in per_tensor])  # type: ignore[union-attr]


def _digest_deviations(reference: RunRecord, run: RunRecord,
                       measure: Callable[[dict, dict], float] = digest_deviation) -> np.ndarray | None:
    """Each final weight's deviation (``digest_deviation``, or ``measure``), by name; None where the run lacks one."""
    if not reference.digests or not set(reference.digests) <= set(run.digests):
        return None
    return np.asarray([measure(run.digests[n], reference.digests[n]) for n in sorted(reference.digests)])


def step0_limit(reference: RunRecord, name: str, bound: float) -> np.ndarray | float:
    """Where ``step0_deviation`` against ``reference`` must stay for two computations that differ only in rounding,
    each element within ``bound`` (bounds.py): ``bound`` per element of a whole tensor, per block of a large one the
    bound of its sum (``step0.block_bound_scale``), so a gradient compared in blocks is held to its elements'."""
    found = step0.full_or_blocks(reference, name)
    if found is None or found[0] != step0.BLOCK_PREFIX:
        return bound
    return bound * step0.block_bound_scale(found[1])


def measure(base: RunRecord, replicas: list[RunRecord]) -> dict[str, np.ndarray]:
    """The envelope arrays: per metric, the largest deviation any replica reached. Along steps the spread is made
    non-decreasing (a running maximum): chaos only grows, and a step where the replicas happened to agree is no
    reason to demand more there than before it."""
    spread: dict[str, np.ndarray] = {}
    for replica in replicas:
        for metric, dev in deviations(base, replica).items():
            if not np.isfinite(dev).all():  # an infinite spread would switch the check off for good
                raise NoisyReplica(f"noise replica {replica.config.get('perturbation', '?')!r} gave a non-finite "
                                   f"{metric} (NaN or inf): the stack is not healthy enough to record a reference")
            spread[metric] = np.maximum(spread[metric], dev) if metric in spread else dev
    return {PREFIX + metric: np.maximum.accumulate(values, axis=0) if metric in PER_STEP else values
            for metric, values in spread.items()}


def limit(reference: RunRecord, metric: str, floor: float) -> np.ndarray | None:
    """K x the stored spread + floor, shaped like the metric's deviations; None without an envelope. Magnitudes a
    reference recorded before their own envelope are held to final_weights'."""
    spread = reference.arrays.get(PREFIX + metric)
    if spread is None and metric == MAGNITUDE:
        spread = reference.arrays.get(PREFIX + "final_weights")
    return None if spread is None else K * spread.astype(np.float64) + floor
