"""Compare a run with its reference. numpy only: this module knows nothing of torch.distributed.

Two lanes:
  exact     the numerics fingerprint matches, so every stored number must be bitwise equal.
            Any difference is reported with its first step and its distance in float32 ulps.
  tolerant  the stack changed (new torch, driver, CPU kernels...), so numbers may move within
            per-metric tolerances. Defaults below are per compute dtype; a later issue replaces
            them with tolerances measured from a noise envelope.

Every finding names the metric, the step, the tensor and its size, expected and got, how far
past its tolerance it is, and the component it points to (see ``_suspect``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stack import fingerprint as fp
from .record import RunRecord

WORST_ROWS = 8
# A step-0 gradient wrong in fewer than this share of its elements points at a collective.
SPARSE_FRACTION = 0.05


@dataclass(frozen=True)
class Tolerances:
    """Tolerant-lane limits. Relative for scalars; for tensors, |a-b| / max|reference|."""

    loss: float
    grad_norm: float
    param_grad_norm: float
    step0_grad: float
    final_weights: float


# fp32 on CPU, measured by benchmarks/noise_margin.py (300 steps, 2 gloo ranks). Max deviation
# from a clean run, legitimate (every linear layer x (1+1e-7)) vs fault (one element of each
# reduce-scatter x (1+1e-4)):
#   loss 2.0e-7 vs 1.7e-7 (the loss alone cannot tell them apart), grad_norm 3.5e-7 vs 6.8e-7,
#   param_grad_norm 1.5e-6 vs 1.3e-5, step-0 gradients 7.9e-7 vs 2.4e-5.
# Each limit sits between the two where they separate, and well above legitimate drift elsewhere.
DEFAULT_TOLERANCES: dict[str, Tolerances] = {
    "fp32": Tolerances(loss=1e-6, grad_norm=2e-6, param_grad_norm=5e-6, step0_grad=5e-6, final_weights=1e-6),
    "bf16": Tolerances(loss=2e-2, grad_norm=5e-2, param_grad_norm=1e-1, step0_grad=5e-2, final_weights=5e-2),
}


@dataclass
class Finding:
    metric: str
    component: str
    message: str  # one line: where and how much
    step: int | None = None
    tensor: str | None = None
    size: str | None = None
    expected: float | None = None
    got: float | None = None
    distance: float = 0.0  # in the lane's measure (ulps or relative)
    tolerance: float = 0.0
    fraction: float | None = None  # share of a tensor's elements that differ
    worst: list[tuple[str, float, float, float]] = field(default_factory=list)  # (where, expected, got, diff)


@dataclass
class Comparison:
    lane: str
    lane_reason: str
    findings: list[Finding]
    stack_changes: list[tuple[str, Any, Any]]

    @property
    def passed(self) -> bool:
        return not self.findings


def choose_lane(reference: RunRecord, run: RunRecord, requested: str = "auto") -> tuple[str, str]:
    changed = fp.numerics_diff(reference.fingerprint, run.fingerprint)
    if requested in ("exact", "tolerant"):
        return requested, f"{requested} lane requested"
    if not changed:
        return "exact", "the numerics fingerprint matches the reference, so results must be bitwise equal"
    names = ", ".join(k for k, _, _ in changed[:4]) + (" ..." if len(changed) > 4 else "")
    return "tolerant", f"the stack changed ({names}), so results may move within tolerances"


def ulps32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 units in the last place (monotone integer ordering of floats)."""

    def ordinal(x: np.ndarray) -> np.ndarray:
        i = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, np.int64(-(2**31)) - i, i)

    return np.abs(ordinal(a) - ordinal(b))


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a64.view(np.int64) != b64.view(np.int64)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny)
    return np.where(np.isnan(a) != np.isnan(b), np.inf, np.nan_to_num(out, nan=0.0, posinf=np.inf))


def _worst(labels: list[str], expected: np.ndarray, got: np.ndarray, diff: np.ndarray) -> list[tuple[str, float, float, float]]:
    order = np.argsort(-diff, kind="stable")[:WORST_ROWS]
    return [(labels[i], float(expected[i]), float(got[i]), float(diff[i])) for i in order if diff[i] > 0]


def _series(metric: str, ref: list[float], got: list[float], lane: str, tol: float) -> Finding | None:
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    n = min(len(r), len(g))
    if len(r) != len(g):
        return Finding(metric, "unknown", f"{metric}: reference has {len(r)} steps, this run {len(g)}")
    bad = _bits_differ(r, g) if lane == "exact" else _rel(g, r) > tol
    if not bad.any():
        return None
    step = int(np.argmax(bad))
    rel = _rel(g[:n], r[:n])
    ulp = ulps32(g[:n], r[:n])
    measure = f"{int(ulp[step])} ulp32" if lane == "exact" else f"rel {rel[step]:.3g} > tol {tol:.3g}"
    return Finding(
        metric=metric,
        component="",
        message=(
            f"{metric}: first differing step {step} of {n}: expected {float(r[step])!r}, got {float(g[step])!r} "
            f"({measure}); {int(bad.sum())} steps differ, max rel {float(rel.max()):.3g}"
        ),
        step=step,
        expected=float(r[step]),
        got=float(g[step]),
        distance=float(ulp[step] if lane == "exact" else rel[step]),
        tolerance=0.0 if lane == "exact" else tol,
        worst=_worst([f"step {i}" for i in range(n)], r, g, rel),
    )


def _param_grad_norms(ref: RunRecord, run: RunRecord, lane: str, tol: float) -> Finding | None:
    r, g = ref.arrays.get("param_grad_norm"), run.arrays.get("param_grad_norm")
    if r is None or g is None:
        return None
    if r.shape != g.shape:
        return Finding("param_grad_norm", "unknown", f"param_grad_norm: shape {r.shape} vs {g.shape}")
    rel = _rel(g, r)
    bad = _bits_differ(r, g) if lane == "exact" else rel > tol
    if not bad.any():
        return None
    steps_bad = np.nonzero(bad.any(axis=1))[0]
    step = int(steps_bad[0])
    params_bad = np.nonzero(bad[step])[0]
    names = ref.param_names or [f"param{i}" for i in range(r.shape[1])]
    first = int(params_bad[0])
    labels = [names[i] for i in range(r.shape[1])]
    return Finding(
        metric="param_grad_norm",
        component="",
        message=(
            f"param_grad_norm: first differing step {step}: {len(params_bad)} of {r.shape[1]} parameters, "
            f"first {names[first]}: expected {float(r[step, first])!r}, got {float(g[step, first])!r} "
            f"(rel {rel[step, first]:.3g})"
        ),
        step=step,
        tensor=names[first],
        expected=float(r[step, first]),
        got=float(g[step, first]),
        distance=float(rel[step, first]),
        tolerance=0.0 if lane == "exact" else tol,
        worst=_worst([f"step {step} {n}" for n in labels], r[step], g[step], rel[step]),
    )


def _step0_grads(ref: RunRecord, run: RunRecord, lane: str, tol: float) -> list[Finding]:
    out: list[Finding] = []
    for key in sorted(k for k in ref.arrays if k.startswith("step0_grad/")):
        name = key.split("/", 1)[1]
        r, g = ref.arrays[key], run.arrays.get(key)
        size = f"{list(r.shape)} = {r.size} elements"
        if g is None or g.shape != r.shape:
            out.append(Finding("step0_grad", "unknown", f"step0_grad {name}: missing or reshaped in this run",
                               step=0, tensor=name, size=size))
            continue
        scale = max(float(np.abs(r).max()), np.finfo(np.float32).tiny)
        diff = np.abs(g.astype(np.float64) - r.astype(np.float64)) / scale
        diff = np.where(np.isnan(g) != np.isnan(r), np.inf, np.nan_to_num(diff, nan=0.0))
        bad = _bits_differ(r, g) if lane == "exact" else diff > tol
        if not bad.any():
            continue
        flat_bad = np.nonzero(bad.reshape(-1))[0]
        first = int(flat_bad[0])
        idx = tuple(int(i) for i in np.unravel_index(first, r.shape))
        rf, gf, df = r.reshape(-1), g.reshape(-1), diff.reshape(-1)
        labels = [str(tuple(int(i) for i in np.unravel_index(j, r.shape))) for j in range(r.size)]
        measure = f"{int(ulps32(gf[first], rf[first]))} ulp32" if lane == "exact" else f"{df[first]:.3g} > tol {tol:.3g}"
        out.append(
            Finding(
                metric="step0_grad",
                component="",
                message=(
                    f"step0_grad {name} {size}: {len(flat_bad)} elements differ "
                    f"({100 * len(flat_bad) / r.size:.3g}%), first at {idx}: expected {float(rf[first])!r}, "
                    f"got {float(gf[first])!r} ({measure}); max |diff|/max|ref| {float(df.max()):.3g}"
                ),
                step=0,
                tensor=name,
                size=size,
                expected=float(rf[first]),
                got=float(gf[first]),
                distance=float(df[first]),
                tolerance=0.0 if lane == "exact" else tol,
                fraction=len(flat_bad) / r.size,
                worst=_worst(labels, rf, gf, df),
            )
        )
    return out


def _final_weights(ref: RunRecord, run: RunRecord, lane: str, tol: float) -> Finding | None:
    bad: list[tuple[str, float, float, float]] = []
    for name, rd in ref.digests.items():
        gd = run.digests.get(name)
        if gd is None:
            bad.append((name, float("nan"), float("nan"), float("inf")))
            continue
        rel = float(_rel(np.asarray(gd["abs_sum"]), np.asarray(rd["abs_sum"])))
        if (rd["sha256"] != gd["sha256"]) if lane == "exact" else rel > tol:
            bad.append((name, float(rd["abs_sum"]), float(gd["abs_sum"]), rel))
    if not bad:
        return None
    bad.sort(key=lambda row: -row[3])
    name = bad[0][0]
    return Finding(
        metric="final_weights",
        component="",
        message=(
            f"final_weights: {len(bad)} of {len(ref.digests)} parameters differ after the last step "
            f"({'sha256' if lane == 'exact' else 'sum |w|'}); largest: {name} (rel {bad[0][3]:.3g})"
        ),
        tensor=name,
        size=str(ref.digests[name].get("shape")),
        distance=bad[0][3],
        tolerance=0.0 if lane == "exact" else tol,
        worst=bad[:WORST_ROWS],
    )


def _suspect(findings: list[Finding]) -> None:
    """Point each finding at a component, from the order in which signals appear.

    - step-0 gradients wrong in a few elements: a collective (reduce-scatter) corrupted them;
      wrong nearly everywhere: a kernel (forward or backward math) changed.
    - loss wrong at step 0 with no step-0 gradients recorded: a kernel or a collective; without
      the gradients there is no evidence to tell them apart, so both are named.
    - step-0 numbers right but training diverges later: the optimizer, the schedule, or a
      collective at a later step (a stale all-gather); the first step says where to look.
    """
    step0 = [f for f in findings if f.metric == "step0_grad"]
    loss = next((f for f in findings if f.metric == "loss"), None)
    for f in step0:
        sparse = f.fraction is not None and f.fraction < SPARSE_FRACTION
        f.component = "collective" if sparse else "kernel"
    for f in findings:
        if f.component:
            continue
        if step0:
            f.component = step0[0].component
        elif loss is not None and loss.step == 0:
            f.component = "kernel or collective"
        else:
            f.component = "optimizer or collective"


def compare_training(
    reference: RunRecord, run: RunRecord, *, lane: str = "auto", tolerances: Tolerances | None = None
) -> Comparison:
    """Compare two training records (losses, gradient norms, step-0 gradients, final weights)."""
    chosen, reason = choose_lane(reference, run, lane)
    dtype = str(reference.config.get("dtype", "fp32"))
    tol = tolerances or DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["bf16"])
    findings: list[Finding] = []
    findings.extend(_step0_grads(reference, run, chosen, tol.step0_grad))
    for metric, limit in (("loss", tol.loss), ("grad_norm", tol.grad_norm)):
        if metric in reference.series:
            found = _series(metric, reference.series[metric], run.series.get(metric, []), chosen, limit)
            if found:
                findings.append(found)
    for extra in (
        _param_grad_norms(reference, run, chosen, tol.param_grad_norm),
        _final_weights(reference, run, chosen, tol.final_weights),
    ):
        if extra:
            findings.append(extra)
    _suspect(findings)
    return Comparison(chosen, reason, findings, fp.diff(reference.fingerprint, run.fingerprint))
