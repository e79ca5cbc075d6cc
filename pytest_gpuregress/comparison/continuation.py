"""A reference seen from a step on: what a run resumed there from the reference's own checkpoint must repeat.

``from_step`` keeps the per-step series, per-parameter norms, envelope and final weights from ``start`` on and
drops what only a run from step 0 has; the ordinary comparison then judges the continuation. numpy only.
"""

from __future__ import annotations

from dataclasses import replace

from ..reference.record import RunRecord
from .envelope import MAGNITUDE, PER_STEP
from .envelope import PREFIX as ENVELOPE_PREFIX

WHOLE_RUN = ("final_weights", MAGNITUDE)  # metrics of the run's end, the same for a continuation


def from_step(reference: RunRecord, start: int) -> RunRecord:
    """``reference`` from step ``start`` to its end, as a record a continuation is compared with."""
    if not 0 <= start < reference.steps:
        raise ValueError(f"step {start} is outside the reference's {reference.steps} steps")
    arrays = {}
    for key, value in reference.arrays.items():
        metric = key.removeprefix(ENVELOPE_PREFIX)
        if metric in PER_STEP:
            arrays[key] = value[start:]
        elif key.startswith(ENVELOPE_PREFIX) and metric in WHOLE_RUN:
            arrays[key] = value
    return replace(reference, series={k: list(v[start:]) for k, v in reference.series.items()}, arrays=arrays,
                   results={}, notes=[])
