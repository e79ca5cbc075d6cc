"""How far a training run's step 0 is from float64, per tensor, and whether a new recording moves toward it.

Every training reference recorded with triage's float64 oracle at hand stores, per step-0 gradient, its
distance from the oracle's: max |diff| / max |float64|, the unit of the step-0 comparison. Re-recording
over a reference (``--gpuregress-record``) is allowed only when the new run is no further from float64
than the old one, tensor by tensor, within the measured noise: the old reference's tolerant-lane limit
for that tensor (K x the noise replicas' spread plus the floor, reference/compare.py). A stack made worse
(a GEMM that lost precision) is refused with both distances; ``--gpuregress-record-anyway`` overrides.
A first recording stores the distance without judging it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import step0
from .envelope import step0_deviation
from .record import RunRecord

RESULT_KEY = "oracle_distance"  # in RunRecord.results: {"per_tensor": {name: distance}, "median": float}
OVERRIDE_FLAG = "--gpuregress-record-anyway"


def distances(run: RunRecord, oracle: RunRecord) -> dict[str, float]:
    """Per step-0 gradient of ``run``: its distance from the float64 ``oracle``'s (inf where it cannot be taken)."""
    out: dict[str, float] = {}
    for name in step0.names(oracle):
        deviation = step0_deviation(run, oracle, name)
        out[name] = float("inf") if deviation is None else float(deviation.max(initial=0.0))
    return out


def attach(run: RunRecord, oracle: RunRecord) -> None:
    """Store ``run``'s distances from ``oracle`` in its results, to be kept with it as a reference."""
    per_tensor = distances(run, oracle)
    run.results[RESULT_KEY] = {"per_tensor": per_tensor,
                               "median": float(np.median(list(per_tensor.values()))) if per_tensor else 0.0}


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
    before = (old.results.get(RESULT_KEY) or {}).get("per_tensor")
    after = (new.results.get(RESULT_KEY) or {}).get("per_tensor")
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

