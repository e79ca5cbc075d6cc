"""How far a training run's step 0 is from float64, per tensor, and whether a new recording moves toward it.

Re-recording is allowed only when no tensor moves further from float64 than the old reference's tolerant limit
(``--gpuregress-record-anyway`` overrides); ``precision_problem`` judges a bf16 run computed with less precision
by the median distance, which the replicas' wide step-0 limits cannot see. docs/envelope.md has both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.record import RunRecord
from . import step0

RESULT_KEY = "oracle_distance"  # in RunRecord.results: {"per_tensor": {name: distance}, "median": float}
OVERRIDE_FLAG = "--gpuregress-record-anyway"


def distances(run: RunRecord, oracle: RunRecord) -> dict[str, float]:
    """Per step-0 gradient of ``run``: its distance from the float64 ``oracle``'s (inf where it cannot be taken)."""
    out: dict[str, float] = {}
    for name in step0.names(oracle):
        deviation = step0.step0_deviation(run, oracle, name)
        out[name] = float("inf") if deviation is None else float(deviation.max(initial=0.0))
    return out


def attach(run: RunRecord, oracle: RunRecord) -> None:
    """Store ``run``'s distances from ``oracle`` in its results, to be kept with it as a reference."""
    per_tensor = distances(run, oracle)
    run.results[RESULT_KEY] = {"per_tensor": per_tensor,
                               "median": float(np.median(list(per_tensor.values()))) if per_tensor else 0.0}


def _per_tensor(record: RunRecord) -> dict[str, float]:
    """The per-tensor distances ``attach`` stored in ``record``; {} where it stores none."""
    return (record.results.get(RESULT_KEY) or {}).get("per_tensor") or {}


@dataclass
class Rerecording:
    """The judgement of a recording over an existing reference."""

    allowed: bool
    reason: str
    worse: list[tuple[str, float, float, float]]  # (tensor, old distance, new distance, allowed slack), worst first

    def refusal(self, name: str, platform_key: str) -> str:
        lines = [f"not re-recording {name!r} on {platform_key}: {self.reason}"]
        lines += [f"  {tensor}: {old:.3g} -> {new:.3g} from float64 (allowed up to {old + slack:.3g})"
                  for tensor, old, new, slack in self.worse[:5]]
        if len(self.worse) > 5:
            lines.append(f"  ... and {len(self.worse) - 5} more tensors")
        lines.append("the stack being recorded computes step 0 further from float64 than the one that recorded the "
                     "reference: a regression, not a new truth (file it against the component that changed). If this "
                     f"is intended, re-record with {OVERRIDE_FLAG}")
        return "\n".join(lines)


def judge_rerecording(old: RunRecord, new: RunRecord, slack: dict[str, float]) -> Rerecording:
    """May ``new`` replace ``old``? ``slack``: per tensor, the old reference's tolerant-lane step-0 limit."""
    before, after = _per_tensor(old), _per_tensor(new)
    if not before:
        return Rerecording(True, "the old reference stores no distance from float64: not judged", [])
    if not after:
        return Rerecording(True, "this run has no float64 oracle to measure against: not judged", [])
    worse = [(name, before[name], after.get(name, float("inf")), float(slack.get(name, 0.0)))
             for name in before if after.get(name, float("inf")) > before[name] + float(slack.get(name, 0.0))]
    worse.sort(key=lambda w: w[2] - w[1] - w[3], reverse=True)
    median_before = float(np.median(list(before.values())))
    median_after = float(np.median([after.get(n, float("inf")) for n in before]))
    summary = f"median distance from float64 {median_before:.3g} -> {median_after:.3g}"
    if worse:
        return Rerecording(False, f"{len(worse)} of {len(before)} step-0 gradients moved further from float64 than "
                                  f"the measured noise allows ({summary})", worse)
    return Rerecording(True, f"no further from float64 within the measured noise ({summary})", [])



# A bf16 run's median step-0 distance from float64 may grow to this multiple of its reference's before it fails.
# Measured on the CPU's bf16 lane (docs/envelope.md has the table): clean paths 1.000x to 1.039x; RMSNorm without
# its float32 upcast 1.28x, truncating fp32 -> bf16 casts 1.39x, both caught with room to spare.
PRECISION_RATIO = 1.15
PRECISION_DTYPES = ("bf16", "fp16")  # fp32 runs: the tolerant lane's own limits are tight enough
PRECISION_METRIC = "step0_precision"  # the comparison's finding (triage/decision.py reads it by this name)


def judges_precision(run: RunRecord) -> bool:
    """Whether ``run`` is held to its reference's distance from float64 (a reduced-precision run): the session then
    measures the run's distance, one float64 launch of step 0, which a reference that stores none leaves unused."""
    return str(run.config.get("dtype", "fp32")) in PRECISION_DTYPES


def _measured_both(before: dict[str, float], after: dict[str, float]) -> list[str]:
    """The tensors whose distance both sides measured: finite in the run, above zero in the reference."""
    return [name for name in before if name in after and np.isfinite(after[name]) and before[name] > 0]


def precision_problem(reference: RunRecord, run: RunRecord) -> str | None:
    """Where a reduced-precision run's step 0 is further from float64 than its reference's by more than
    PRECISION_RATIO (medians over the step-0 gradients both measured): the finding's text; None otherwise (an
    fp32 run, or a side that measured no distance)."""
    if not judges_precision(run):
        return None
    before, after = _per_tensor(reference), _per_tensor(run)
    names = _measured_both(before, after)
    if not names:
        return None
    then = float(np.median([before[n] for n in names]))
    now = float(np.median([after[n] for n in names]))
    if now <= PRECISION_RATIO * then:
        return None
    ratios = sorted(((after[n] / before[n], n) for n in names), reverse=True)
    further = sum(1 for ratio, _ in ratios if ratio > 1.0)
    worst_ratio, worst = ratios[0]
    return (f"step 0 is further from float64 than the reference's: median distance {then:.3g} -> {now:.3g} "
            f"({now / then:.2f}x, allowed {PRECISION_RATIO:g}x), {further} of {len(names)} gradients further, most "
            f"{worst} ({worst_ratio:.2f}x): this stack computes {run.config.get('dtype')} with less precision (a "
            "missing float32 upcast, a lower-precision accumulation), which the replicas' spread cannot see")
