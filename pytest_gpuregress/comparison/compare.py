"""Compare a run with its reference. numpy only: this module knows nothing of torch.distributed.

Two lanes: exact (same numerics fingerprint: every number bitwise equal, differences in float32 ulps) and
tolerant (the stack changed: K x the stored noise envelope plus a floor, or fixed per-dtype limits).
Findings carry facts; triage names the component (triage/naming.py). docs/envelope.md has the lanes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..evidence import data_change, model_layout, oracle_distance, oracle_step0, step0
from ..evidence.first_moved import FirstMoved, equal_traces, first_moved, pairings
from ..evidence.introduced import Traced, describe_thresholds, introduced_at, shape_dependence
from ..evidence.trace_pairs import changed_code, new_dtypes, swapped_backend
from ..evidence.trace_pairs import notes as sequence_notes
from ..reference import by_name
from ..reference.record import RunRecord
from ..stack import fingerprint as fp
from ..stack.determinism import nondeterminism
from .envelope import MAGNITUDE, METRICS, SERIES, MetricLimits, digest_deviation, floors_for, limit, magnitude_deviation, rel
from .envelope import PREFIX as ENVELOPE_PREFIX

WORST_ROWS = 8


Tolerances = MetricLimits  # explicit limits, one per metric, for compare_training(tolerances=...)


# Limits for references that carry no noise envelope (a user's own loop, a reference recorded with
# --gpuregress-replicas=0). fp32 on CPU, measured by benchmarks/noise_margin.py (300 steps, 2 gloo
# ranks): legitimate drift (every linear layer x (1+1e-7)) vs a fault (one element of each
# reduce-scatter x (1+1e-4)): loss 2.0e-7 vs 1.7e-7 (the loss alone cannot tell them apart),
# grad_norm 3.5e-7 vs 6.8e-7, param_grad_norm 1.5e-6 vs 1.3e-5, step-0 gradients 7.9e-7 vs 2.4e-5.
# The bf16 values are rough: references recorded with replicas use the measured envelope instead.
DEFAULT_TOLERANCES: dict[str, Tolerances] = {
    "fp32": Tolerances(loss=1e-6, grad_norm=2e-6, param_grad_norm=5e-6, step0_grad=5e-6, final_weights=1e-6),
    "bf16": Tolerances(loss=2e-2, grad_norm=5e-2, param_grad_norm=1e-1, step0_grad=5e-2, final_weights=5e-2),
}


@dataclass
class Finding:
    """What differs from the reference: the metric, where and how much, and the facts measured. The component it
    points at is triage's to name (triage/naming.py), by the rule ``rule``."""

    metric: str
    message: str  # one line: where and how much
    step: int | None = None
    tensor: str | None = None
    size: str | None = None
    expected: float | None = None
    got: float | None = None
    distance: float = 0.0  # in the lane's measure (ulps or relative)
    tolerance: float = 0.0
    fraction: float | None = None  # share of a tensor's elements (or blocks, see ``unit``) that differ
    unit: str = "elements"
    worst: list[tuple[str, float, float, float]] = field(default_factory=list)  # (where, expected, got, diff)
    # Where every differing element is the same multiple of the reference's (a divide skipped or done twice): that
    # factor, and what it equals in this run's arithmetic ("the world size 2"); None where no one factor fits.
    factor: float | None = None
    factor_is: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # "missing", "before_save", "built_by", ...
    component: str = ""  # named by triage/naming.py
    rule: str = ""  # the id of the rule that named it


@dataclass
class Comparison:
    lane: str
    lane_reason: str
    findings: list[Finding]
    stack_changes: list[tuple[str, Any, Any]]
    # metric -> largest deviation as a multiple of its tolerant-lane limit, in either lane: how close
    # this run came to failing on another stack (0 when bitwise equal).
    margins: dict[str, float] = field(default_factory=dict)
    limits_from: str = "fixed"  # "envelope" when the reference carries one
    # Ops whose kernels changed since the reference (evidence/kernels.py), set by the session; triage's evidence.
    kernel_changes: list[str] | None = None
    # The first op of step 0 whose output moved (evidence/first_moved.py): None where every op is bitwise equal or a
    # record has no op trace. Also set when the comparison passes: where bitwise drift starts, as information.
    first_moved: FirstMoved | None = None
    # (ranks, ops per rank) where both records traced step 0 and no op moved: "no drift", said as information.
    equal_trace: tuple[int, int] | None = None
    # The tolerant lane's op of step 0 that introduced a difference beyond drift (evidence/introduced.py), or None.
    introduced: FirstMoved | None = None
    introduced_rule: str = ""  # what "beyond drift" meant: the reference's thresholds, in words
    # Where the culprit is a compute op wrong at some input shapes only: the line naming them (shape_dependence).
    shape_note: str | None = None
    # What changed in step 0's op sequence (trace_pairs.notes): ops relabelled, inserted, removed or replaced, one
    # note per kind and place, from the lowest rank whose sequence changed. The analysis pairs the ops around them.
    sequence_notes: list[str] = field(default_factory=list)
    # The packages whose code runs the ops inserted, removed or replaced in step 0 (trace_pairs.changed_code).
    changed_code: list[str] = field(default_factory=list)
    # An op among torch's backend choices (trace_pairs.swapped_backend): the same call, so no library's evidence.
    swapped_backend: str | None = None
    # (ops paired, ops of this run) of step 0's trace on the lowest rank whose sequence changed: where less than half
    # is paired, the op that introduced the difference is no evidence on its own (triage/decision.py).
    paired_ops: tuple[int, int] | None = None
    # Dtypes the inserted ops compute in that no op of the reference's step 0 did (trace_pairs.new_dtypes).
    new_dtypes: list[str] = field(default_factory=list)
    adamw: str | None = None  # the AdamW implementation the run used (training/optimizer.py), where it says
    # The run registers the model's parameters in another order than the reference (the same names and shapes):
    # sums over parameters (the clip's norm, the recorded norms) follow that order, so their last bits may move.
    reordered: bool = False
    notes: list[str] = field(default_factory=list)  # information about how the comparison was made

    @property
    def culprit(self) -> FirstMoved | None:
        """The op a failure names and triage weighs: in the exact lane the first op that moved (no drift is
        allowed there; a changed op sequence is a difference too); in the tolerant lane the op that introduced a
        difference, never plain drift."""
        if self.lane == "exact":
            return self.first_moved
        return self.introduced

    @property
    def passed(self) -> bool:
        return not self.findings

    def finding(self, *metrics: str) -> Finding | None:
        """The first finding of one of ``metrics``."""
        return next((f for f in self.findings if f.metric in metrics), None)


def choose_lane(reference: RunRecord, run: RunRecord, requested: str = "auto") -> tuple[str, str]:
    changed = fp.numerics_diff(reference.fingerprint, run.fingerprint)
    if requested in ("exact", "tolerant"):
        return requested, f"{requested} lane requested"
    for whose, record in (("this run", run), ("the reference", reference)):
        reason = nondeterminism(record.fingerprint)
        if reason:  # bitwise equality cannot be expected even on an unchanged stack
            return "tolerant", f"{whose} could not be made deterministic ({reason}), so results may move within tolerances"
    if not changed:
        return "exact", "the numerics fingerprint matches the reference, so results must be bitwise equal"
    return "tolerant", f"the stack changed ({fp.summarize_changes(changed)}), so results may move within tolerances"


def ulps32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 units in the last place (monotone integer ordering of floats)."""
    return np.abs(_ordinal(a, 32) - _ordinal(b, 32))


def _ordinal(x: np.ndarray, bits: int) -> np.ndarray:
    """Floats of ``bits`` bits as integers in their order, in a type wide enough for their differences: int64 for
    float32's, Python's own integers (exact: the ordinals span 2**64) for float64's."""
    floats, ints, wide = (np.float32, np.int32, np.int64) if bits == 32 else (np.float64, np.int64, object)
    i = np.asarray(x, dtype=floats).view(ints).astype(wide)
    return np.where(i < 0, -(2 ** (bits - 1)) - i, i)


def ulp_distance(got: float, expected: float) -> str:
    """How far apart two values are in ulps: in float32's where they differ there, else in float64's, so values
    that differ never read as "0 ulp32" (a float64 loss or norm can move below one float32 ulp)."""
    apart = int(ulps32(np.float64(got), np.float64(expected)))
    if apart or got == expected or got != got or expected != expected:
        return f"{apart} ulp32"
    return f"{int(abs(_ordinal(np.float64(got), 64) - _ordinal(np.float64(expected), 64)))} ulp64, within one float32 ulp"


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a64.view(np.int64) != b64.view(np.int64)


def _worst(
    label: Callable[[int], str], expected: np.ndarray, got: np.ndarray, diff: np.ndarray
) -> list[tuple[str, float, float, float]]:
    """The largest entries of ``diff`` (flat arrays), labelled only for those rows: cheap on large tensors."""
    count = min(WORST_ROWS, diff.size)
    if count == 0:
        return []
    top = np.argpartition(-diff, count - 1)[:count]
    top = top[np.argsort(-diff[top], kind="stable")]
    return [(label(int(i)), float(expected[i]), float(got[i]), float(diff[i])) for i in top if diff[i] > 0]


@dataclass(frozen=True)
class _Check:
    """One metric's values, deviations and limits, shaped alike, and the lane's verdict per entry."""

    ref: np.ndarray
    got: np.ndarray
    dev: np.ndarray
    limit: np.ndarray
    bad: np.ndarray
    lane: str

    @classmethod
    def of(cls, dev: np.ndarray, limit: np.ndarray, lane: str, ref: np.ndarray, got: np.ndarray,
           bits: np.ndarray | None = None) -> _Check:
        """``bits``: the exact lane's verdict where it is not ``ref`` against ``got`` (blocks: any element's bits)."""
        # not (dev <= limit): a NaN deviation or limit fails, never passes
        bad = (_bits_differ(ref, got) if bits is None else bits) if lane == "exact" else ~(dev <= limit)
        return cls(ref, got, dev, np.broadcast_to(limit, dev.shape), bad, lane)

    def margin(self) -> float:
        if self.dev.size == 0:
            return 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(self.dev > 0, self.dev / self.limit, 0.0)
        return float(np.max(ratio))

    def finding(self, metric: str, at: Any, head: str, tail: str = "", expected_is: str = "", **fields: Any) -> Finding:
        """The finding for entry ``at``: "<head>: expected <value>, got <value> (<how far>)<tail>", with the values,
        the distance and the limit there."""
        expected, got = float(self.ref[at]), float(self.got[at])
        exact = self.lane == "exact"
        measure = ulp_distance(got, expected) if exact else f"{float(self.dev[at]):.3g} > tol {float(self.limit[at]):.3g}"
        return Finding(metric, f"{head}: expected {expected_is}{expected!r}, got {got!r} ({measure}){tail}",
                       expected=expected, got=got, distance=float(self.dev[at]),
                       tolerance=0.0 if exact else float(self.limit[at]), **fields)


def _missing(metric: str, message: str, **fields: Any) -> Finding:
    return Finding(metric, message, facts={"missing": True}, **fields)


# Each metric's check gives its findings and its margin, the largest deviation as a multiple of its limit; a margin
# of None where the reference keeps no such metric.
Checked = tuple[list[Finding], float | None]


def _series(metric: str, ref: list[float], got: list[float], lane: str, limit: np.ndarray) -> Checked:
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if len(r) != len(g):
        return [_missing(metric, f"{metric}: reference has {len(r)} steps, this run {len(g)}")], float("inf")
    check = _Check.of(rel(g, r), limit, lane, r, g)
    if not check.bad.any():
        return [], check.margin()
    step = int(np.argmax(check.bad))
    finding = check.finding(metric, step, f"{metric}: first differing step {step} of {len(r)}",
                            f"; {int(check.bad.sum())} steps differ, max rel {float(check.dev.max()):.3g}",
                            step=step, worst=_worst(lambda i: f"step {i}", r, g, check.dev))
    if lane == "exact":  # a loss or norm is measured in ulps there
        finding.distance = float(ulps32(g, r)[step])
    return [finding], check.margin()


def _param_grad_norms(ref: RunRecord, run: RunRecord, lane: str, limit: np.ndarray) -> Checked:
    r, g = ref.arrays.get("param_grad_norm"), by_name.param_grad_norms(ref, run)[0]
    if r is None:
        return [], None
    if g is None:
        return [_missing("param_grad_norm", "param_grad_norm: recorded in the reference, missing in this run")], float("inf")
    if r.shape != g.shape:
        return [_missing("param_grad_norm", f"param_grad_norm: shape {r.shape} vs {g.shape}")], float("inf")
    check = _Check.of(rel(g, r), limit, lane, r, g)
    if not check.bad.any():
        return [], check.margin()
    step = int(np.nonzero(check.bad.any(axis=1))[0][0])
    params_bad = np.nonzero(check.bad[step])[0]
    names = ref.param_names or [f"param{i}" for i in range(r.shape[1])]
    first = int(params_bad[0])
    finding = check.finding(
        "param_grad_norm", (step, first),
        f"param_grad_norm: first differing step {step}: {len(params_bad)} of {r.shape[1]} parameters, first {names[first]}",
        step=step, tensor=names[first],
        worst=_worst(lambda i: f"step {step} {names[i]}", r[step], g[step], check.dev[step]),
    )
    return [finding], check.margin()


def _step0_grads(ref: RunRecord, run: RunRecord, lane: str, limits: dict[str, float]) -> Checked:
    out: list[Finding] = []
    margin = 0.0
    names = step0.names(ref)
    for name in names:
        prefix, r = step0.full_or_blocks(ref, name)  # type: ignore[misc]
        g = run.arrays.get(prefix + name)
        blocked = prefix == step0.BLOCK_PREFIX
        shape = tuple(ref.digests.get(name, {}).get("shape", ())) if blocked else r.shape
        size = (f"{list(shape)} in {len(r)} blocks of {step0.BLOCK}" if blocked else f"{list(r.shape)} = {r.size} elements")
        if g is None or (not step0.same_layout(g, r) if blocked else g.shape != r.shape):
            out.append(_missing("step0_grad", f"step0_grad {name}: missing or reshaped in this run", step=0, tensor=name,
                                size=size))
            continue
        check, where = _step0_check(r, g, shape, blocked, lane, np.asarray(limits[name]))
        margin = max(margin, check.margin())
        if check.bad.any():
            out.append(_step0_finding(name, size, "blocks" if blocked else "elements", check, where, run.world_size))
    return out, margin if names else None


def _step0_check(r: np.ndarray, g: np.ndarray, shape: tuple[int, ...], blocked: bool, lane: str,
                 limit: np.ndarray) -> tuple[_Check, Callable[[int], str]]:
    """A step-0 gradient's check, per element of a whole tensor or per block sum of a large one, and how an entry
    is named (an element's index, a block's range)."""
    if blocked:
        check = _Check.of(step0.block_deviation(g, r), limit, lane, step0.block_sums(r), step0.block_sums(g),
                          bits=_bits_differ(r, g).any(axis=1))
        return check, lambda j: step0.block_label(r, j, shape)
    rf, gf = r.reshape(-1), g.reshape(-1)
    return (_Check.of(step0.tensor_deviation(gf, rf), limit, lane, rf, gf),
            lambda j: str(tuple(int(i) for i in np.unravel_index(j, shape))))


def _step0_finding(name: str, size: str, unit: str, check: _Check, where: Callable[[int], str],
                   world_size: int) -> Finding:
    flat_bad = np.nonzero(check.bad)[0]
    first = int(flat_bad[0])
    factor = uniform_factor(check.ref, check.got)  # over the whole tensor: a divide skipped scales every element alike
    factor_is = arithmetic_of(factor, world_size)
    scaled = "" if factor is None else (f"; every one of them is exactly {factor:.6g}x the reference's"
                                        f"{f' ({factor_is})' if factor_is else ''}")
    return check.finding(
        "step0_grad", first,
        f"step0_grad {name} {size}: {len(flat_bad)} {unit} differ ({100 * len(flat_bad) / len(check.dev):.3g}%), "
        f"first at {where(first)}",
        f"; max |diff|/max|ref| {float(check.dev.max()):.3g}{scaled}", "block sum " if unit == "blocks" else "",
        step=0, tensor=name, size=size, fraction=len(flat_bad) / len(check.dev), unit=unit,
        worst=_worst(where, check.ref, check.got, check.dev), factor=factor, factor_is=factor_is,
    )


def uniform_factor(expected: np.ndarray, got: np.ndarray, rel: float = 1e-3) -> float | None:
    """The one factor k with got = k * expected in every element of a tensor (to ``rel`` of its largest value), k not
    1; None where none fits. A kernel's error is no common multiple of a whole tensor; arithmetic (a divide skipped)
    is. The factor is read off the elements of some size, where drift cannot hide it."""
    expected, got = expected.astype(np.float64), got.astype(np.float64)
    if not (np.all(np.isfinite(got)) and np.all(np.isfinite(expected))) or not expected.size:
        return None
    sizable = np.abs(expected) >= 0.01 * np.abs(expected).max()
    if sizable.sum() < 2 or not np.abs(expected).max():
        return None
    factor = float(np.median(got[sizable] / expected[sizable]))
    if abs(factor - 1.0) <= rel or not np.all(np.abs(got - factor * expected) <= rel * np.abs(got).max()):
        return None
    return factor


def arithmetic_of(factor: float | None, world_size: int) -> str | None:
    """What a common factor equals in a run's arithmetic: the world size, or its inverse (a divide by the number of
    ranks skipped, or done twice); None for any other factor."""
    if factor is None or world_size < 2:
        return None
    for value, said in ((world_size, f"the world size {world_size}"), (1 / world_size, f"1 / the world size {world_size}")):
        if abs(factor - value) <= 1e-3 * value:
            return said
    return None


def _final_weights(ref: RunRecord, run: RunRecord, lane: str, limits: dict[str, float],
                   magnitudes: dict[str, float]) -> Checked:
    """Final weights past their limit: in the tolerant lane each tensor's digests against final_weights' limit, and its
    sum of |w| against its own (``magnitudes``: the weight_magnitude envelope's, else final_weights')."""
    if not ref.digests:
        return [], None
    bad, margin = _digests_differ(ref, run, lane, limits, magnitudes)
    if not bad:
        return [], margin
    name, _, _, distance, tolerance, measure = bad[0]
    exact = lane == "exact"
    message = (f"final_weights: {len(bad)} of {len(ref.digests)} parameters differ after the last step "
               f"({'sha256' if exact else 'sum, sum of |w| and signed checksum'}); largest: {name} "
               f"({measure} rel {distance:.3g}" + ("" if exact else f" > tol {tolerance:.3g}") + ")")
    return [Finding("final_weights", message, tensor=name, size=str(ref.digests[name].get("shape")), distance=distance,
                    tolerance=0.0 if exact else tolerance, worst=[row[:4] for row in bad[:WORST_ROWS]])], margin


def _digests_differ(ref: RunRecord, run: RunRecord, lane: str, limits: dict[str, float],
                    magnitudes: dict[str, float]) -> tuple[list[tuple[str, float, float, float, float, str]], float]:
    """The final weights that differ, as (name, sum of |w| expected, got, deviation, its limit, the measure) rows, the
    furthest past its limit first (the exact lane: the largest deviation; a tensor the run lacks: inf), and the
    margin of those it has. Each tensor is judged by the measure nearer its limit: the checksums against
    final_weights', its sum of |w| against its own."""
    bad: list[tuple[str, float, float, float, float, str]] = []
    margin = 0.0
    for name in sorted(ref.digests):
        rd, gd = ref.digests[name], run.digests.get(name)
        if gd is None:
            bad.append((name, float("nan"), float("nan"), float("inf"), limits[name], "checksums"))
            continue
        checked = [(digest_deviation(gd, rd), limits[name], "checksums"),
                   (magnitude_deviation(gd, rd), magnitudes[name], "sum of |w|")]
        dev, tol, measure = max(checked, key=lambda row: row[0] / row[1] if row[1] else float("inf"))
        margin = max(margin, dev / tol if dev > 0 else 0.0)
        if (rd["sha256"] != gd["sha256"]) if lane == "exact" else not dev <= tol:
            bad.append((name, float(rd["abs_sum"]), float(gd["abs_sum"]), dev, tol, measure))
    past = (lambda row: row[3]) if lane == "exact" else (lambda row: row[3] / row[4] if row[4] else float("inf"))
    return sorted(bad, key=past, reverse=True), margin


def gradients_moved_first(findings: list[Finding], lane: str) -> bool:
    """Whether a step's gradients differ while its loss (computed before them, from the same weights) is bitwise
    equal: computed wrong, which no optimizer step explains. Exact lane only: in the tolerant lane a per-parameter
    norm can cross its own limit before the loss does. A clip that moved first is ``clip_moved_first``'s."""
    if lane != "exact" or clip_moved_first(findings) is not None:
        return False
    first = {f.metric: f.step for f in reversed(findings) if f.step is not None}  # each metric's first step
    return first.get("param_grad_norm", _NO_STEP) < first.get("loss", _NO_STEP) < _NO_STEP


_NO_STEP = float("inf")  # a metric with no finding at a step moved at no step


def clip_moved_first(findings: list[Finding]) -> Finding | None:
    """The clipped-norm finding when it comes before every other: a step's loss and gradients (before clipping) are
    computed before its clip, so a clip that went wrong at step s moves them from step s + 1 on, never at s."""
    clip = next((f for f in findings if f.metric == "clipped_grad_norm"), None)
    if clip is None or clip.step is None:
        return None
    # Final weights carry no step: they follow from whatever moved first.
    others = [f for f in findings if f is not clip and f.metric != "final_weights"]
    return clip if all(_moved_at(f) > clip.step for f in others) else None


def _moved_at(finding: Finding) -> float:
    """The step a finding moved at, to order findings: a step-0 gradient at 0; one that names no step before any
    (nothing shows that it came later)."""
    if finding.metric == "step0_grad":
        return 0
    return -_NO_STEP if finding.step is None else finding.step


def tolerant_limits(reference: RunRecord, tolerances: Tolerances | None = None) -> tuple[dict[str, Any], str]:
    """Per-metric tolerant-lane limits: K x envelope + floor where the reference has an envelope, else fixed."""
    dtype = str(reference.config.get("dtype", "fp32"))
    fixed = tolerances or DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["bf16"])
    floors = floors_for(dtype)
    names, digests = step0.names(reference), sorted(reference.digests)
    has_envelope = tolerances is None and any(k.startswith(ENVELOPE_PREFIX) for k in reference.arrays)
    param = reference.arrays.get("param_grad_norm")
    shapes = {"step0_grad": len(names), "final_weights": len(digests), MAGNITUDE: len(digests),
              "param_grad_norm": 0 if param is None else param.shape,
              **{metric: len(reference.series.get(metric, [])) for metric in SERIES}}  # of the fixed limits
    out: dict[str, Any] = {}
    for metric in METRICS:
        enveloped = limit(reference, metric, floors.of(metric)) if has_envelope else None
        out[metric] = np.full(shapes[metric], fixed.of(metric), dtype=np.float64) if enveloped is None else enveloped
    out["step0_grad"] = dict(zip(names, out["step0_grad"].tolist()))
    out["final_weights"] = dict(zip(digests, out["final_weights"].tolist()))
    out[MAGNITUDE] = dict(zip(digests, out[MAGNITUDE].tolist()))
    return out, "envelope" if has_envelope else "fixed"


def compare_training(
    reference: RunRecord, run: RunRecord, *, lane: str = "auto", tolerances: Tolerances | None = None,
    tied: bool | None = None,
) -> Comparison:
    """Compare two training records (losses, gradient norms, step-0 gradients, final weights). ``tolerances``
    replaces the envelope and the fixed limits with explicit ones; ``tied``: whether the model's config ties its
    input and output embeddings, which a tie that differs from the reference's is judged by."""
    chosen, reason = choose_lane(reference, run, lane)
    limits, source = tolerant_limits(reference, tolerances)
    findings, margins = _metric_findings(reference, run, chosen, limits)
    model = _model_findings(reference, run, tied)
    findings = [*model, *findings, *_float64_findings(reference, run, model, margins)]
    comparison = Comparison(chosen, reason, findings, fp.diff(reference.fingerprint, run.fingerprint), margins, source,
                            adamw=run.config.get("adamw"))
    order_note = by_name.param_grad_norms(reference, run)[1]
    comparison.reordered = order_note == by_name.REORDERED
    comparison.notes += [order_note] if order_note else []
    _trace_evidence(reference, run, comparison)
    return comparison


def _float64_findings(reference: RunRecord, run: RunRecord, model: list[Finding],
                      margins: dict[str, float]) -> list[Finding]:
    """Step 0 against the float64 oracle: a reduced-precision run further from it than its reference; the oracle
    itself moved, past the ~1e-15 kernels move it (the code computes another function, which bf16's wide limits and
    the distance from this stack's equally wrong oracle both miss). Other token batches move the oracle too: the
    data finding among ``model`` says so instead."""
    out: list[Finding] = []
    less_precise = oracle_distance.precision_problem(reference, run)
    if less_precise is not None:
        out.append(Finding(oracle_distance.PRECISION_METRIC, less_precise, step=0, tensor="every step-0 gradient"))
    code = None if any(f.metric == "data" for f in model) else oracle_step0.kept_change(reference, run)
    if code is not None:
        out.append(Finding(oracle_step0.METRIC, code.describe(), step=0, tensor=code.tensor, distance=code.relative,
                           tolerance=oracle_step0.CODE_CHANGE))
        margins[oracle_step0.METRIC] = code.relative / oracle_step0.CODE_CHANGE
    return out


def _metric_findings(reference: RunRecord, run: RunRecord, lane: str,
                     limits: dict[str, Any]) -> tuple[list[Finding], dict[str, float]]:
    """What differs metric by metric (step-0 gradients, the series, per-parameter norms, final weights), and each
    metric's margin: its largest deviation as a multiple of its limit. A metric the reference never kept has none."""
    checked = {"step0_grad": _step0_grads(reference, run, lane, limits["step0_grad"])}
    checked |= {metric: _series(metric, reference.series[metric], run.series.get(metric, []), lane, limits[metric])
                for metric in SERIES if metric in reference.series}
    checked["param_grad_norm"] = _param_grad_norms(reference, run, lane, limits["param_grad_norm"])
    checked["final_weights"] = _final_weights(reference, run, lane, limits["final_weights"], limits[MAGNITUDE])
    findings = [finding for found, _ in checked.values() for finding in found]
    return findings, {metric: margin for metric, (_, margin) in checked.items() if margin is not None}


def _model_findings(reference: RunRecord, run: RunRecord, tied: bool | None) -> list[Finding]:
    """What changed under the numbers, to lead the findings it explains: the model's layout (or a tie its config does
    not ask for), then the token batches."""
    out: list[Finding] = []
    data_finding(reference, run, out)
    tie = model_layout.tie_built_otherwise(reference, run, tied)
    if tie is not None:
        out.insert(0, Finding(model_layout.METRIC, tie[1], facts={"built_by": tie[0]}))
    elif changed := model_layout.layout_change(reference, run):
        out.insert(0, Finding(model_layout.METRIC, changed,
                              facts={"adapters_only": model_layout.adapters_only(reference, run)}))
    return out


def _trace_evidence(reference: RunRecord, run: RunRecord, comparison: Comparison) -> None:
    """What step 0's op traces say, both records' traces paired op by op once: the first op that moved, what changed
    in the op sequence of the lowest rank where it did (whose code, which backend, how much was paired, in which
    dtypes), the op that introduced the difference beyond drift (the tolerant lane), and its shapes."""
    paired = pairings(reference, run)
    comparison.first_moved = first_moved(reference, run, sequence=comparison.lane == "exact", paired=paired)
    comparison.equal_trace = equal_traces(reference, run, paired)
    departed = next(((ref, got, p) for ref, got, p in paired.values() if not p.complete), None)
    if departed is not None:
        ref, got, pairing = departed
        comparison.sequence_notes = sequence_notes(pairing, ref, got)
        comparison.changed_code = changed_code(pairing, ref, got)
        comparison.swapped_backend = swapped_backend(pairing, ref, got)
        comparison.paired_ops = (len(pairing.pairs), pairing.run_len)
        comparison.new_dtypes = new_dtypes(pairing, ref, got)
    traced = None  # both records' traces side by side: set up once, for the introducing op and the shapes
    if comparison.lane == "tolerant" and comparison.first_moved is not None:
        traced = Traced.of(reference, run, paired)
        if traced is not None:
            comparison.introduced = introduced_at(reference, run, traced)
            comparison.introduced_rule = describe_thresholds(reference)
    if comparison.culprit is not None and comparison.findings:
        comparison.shape_note = shape_dependence(reference, run, comparison.culprit, traced)


ROUND_TRIP = "round trip"  # a finding's metric: a save or load that failed, whatever the data


def data_finding(reference: RunRecord, run: RunRecord, findings: list[Finding]) -> bool:
    """Where the run trained on other token batches than the reference: a finding naming the step and what made them
    (a random stream, numpy, the token file) leads, and triage names what follows from it (triage/naming.py). True
    where the batches differ."""
    changed = data_change.first_changed_step(reference, run)
    if changed is None:
        return False
    findings.insert(0, Finding("data", data_change.finding_text(reference, run, changed), step=changed,
                               tensor="the token batch"))
    return True
