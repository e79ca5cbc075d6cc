"""The gradients of a late step, judged as step 0's are: what catches a small fault that starts late.

A resume case's first step computes its gradients from exactly the reference's state at step S, so they are
compared element by element (``as_step0``, ``late_grad``) with no drift to hide in (docs/envelope.md, "Late small
faults"). Arrays use step 0's form under their own prefixes (evidence/step0.py ``LATE``). numpy only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...comparison.envelope import PREFIX as ENVELOPE_PREFIX
from ...comparison.envelope import NoisyReplica
from ...evidence import step0
from ...reference.record import RunRecord

LATE_ONLY = "resume_late_only"  # session-only config key: the launch runs the checkpoint's step only
ENVELOPE = ENVELOPE_PREFIX + "late_grad"
METRIC = "late_grad"


# --- session side ----------------------------------------------------------------------------------


def as_step0(record: RunRecord) -> RunRecord:
    """``record`` with its late gradients (and their envelope) in step 0's place, for the step-0 comparison."""
    arrays = {k: v for k, v in record.arrays.items() if not k.startswith(step0.STEP0)}
    arrays.update(step0.renamed(record.arrays, step0.LATE, step0.STEP0))
    if ENVELOPE in record.arrays:
        arrays[ENVELOPE_PREFIX + "step0_grad"] = record.arrays[ENVELOPE]
    return replace(record, arrays=arrays)


def late_arrays(record: RunRecord) -> dict[str, np.ndarray]:
    return {k: v for k, v in record.arrays.items() if k.startswith(step0.LATE)}


def spread(reference: RunRecord, replicas: list[RunRecord]) -> np.ndarray:
    """Per tensor (in step0.names order), the largest deviation any replica's late gradients reached from the
    reference's, in the step-0 comparison's measure."""
    base = as_step0(reference)
    names = step0.names(base)
    out = np.zeros(len(names))
    for replica in replicas:
        seen = as_step0(replica)
        for i, name in enumerate(names):
            deviation = step0.step0_deviation(seen, base, name)
            if deviation is None or not np.isfinite(deviation).all():
                raise NoisyReplica(f"noise replica {replica.config.get('perturbation', '?')!r} gave late gradients "
                                   f"of {name} that are missing, reshaped or not finite")
            out[i] = max(out[i], float(deviation.max()) if deviation.size else 0.0)
    return out


def has_late(record: RunRecord) -> bool:
    return any(k.startswith(step0.LATE) for k in record.arrays)
