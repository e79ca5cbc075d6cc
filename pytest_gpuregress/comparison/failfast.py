"""--gpuregress-fail-fast: compare each step with the reference while training, stop at the first miss. numpy only.

Ranks check each step against a ``watch`` made from the reference and stop together without a collective (the
values are global). Stopping always uses the tolerant lane's limits; a bitwise difference within them is still
reported by the comparison after the run, which ``truncated_reference`` cuts to the steps that ran.
"""

from __future__ import annotations

from copy import copy
from typing import Any

import numpy as np

from ..reference.record import RunRecord
from .envelope import PER_STEP, rel
from .envelope import PREFIX as ENVELOPE_PREFIX

WATCHED = ("loss", "grad_norm")  # what each step reports to the ranks' vote (training/loop.py)


def watch_from(reference: RunRecord | None, limits: dict[str, Any]) -> dict[str, Any]:
    """What ranks need to judge each step: reference values and limits per watched metric (JSON-ready). ``agree``:
    the ranks vote every step, so they stop together; set even without a reference (a rank that cannot read it
    must still vote, or its peers would wait for it)."""
    watch: dict[str, Any] = {"agree": True}
    if reference is None:
        return watch
    for metric in WATCHED:
        values = reference.series.get(metric)
        if values:
            watch[metric] = {"expected": [float(v) for v in values],
                             "limit": [float(v) for v in np.broadcast_to(limits[metric], (len(values),))]}
    return watch


def first_miss(watch: dict[str, Any], step: int, values: dict[str, float]) -> dict[str, Any] | None:
    """The first watched metric at ``step`` outside its limit, as a JSON-ready finding; None when all fit."""
    for metric, got in values.items():
        ref = watch.get(metric) if metric in WATCHED else None
        if ref is None or step >= len(ref["expected"]):
            continue
        expected, limit = ref["expected"][step], ref["limit"][step]
        deviation = float(rel(np.asarray(got), np.asarray(expected)))
        if not deviation <= limit:  # a NaN is a miss
            return {"step": step, "metric": metric, "expected": expected, "got": float(got),
                    "deviation": deviation, "limit": limit, "steps": len(ref["expected"])}
    return None


def peer_miss(watch: dict[str, Any], step: int) -> dict[str, Any]:
    """This rank's values fit, another rank's did not: stop here too, and say so."""
    steps = max((len(v["expected"]) for v in watch.values() if isinstance(v, dict)), default=0)
    return {"step": step, "metric": None, "steps": steps}


def describe(stop: dict[str, Any]) -> str:
    where = f"fail-fast: stopped at step {stop['step']} of {stop['steps']}: "
    if stop.get("metric") is None:
        return where + "another rank's loss or gradient norm left the tolerance (the ranks disagree)"
    return (where + f"{stop['metric']} expected {stop['expected']!r}, got {stop['got']!r} "
            f"(rel {stop['deviation']:.3g} > tol {stop['limit']:.3g})")


def truncated_reference(reference: RunRecord, steps: int) -> RunRecord:
    """The reference cut to the first ``steps`` steps; final weights dropped (the run never reached them)."""
    cut = copy(reference)
    cut.series = {k: list(v[:steps]) for k, v in reference.series.items()}
    cut.arrays = {key: value[:steps] if key.removeprefix(ENVELOPE_PREFIX) in PER_STEP else value
                  for key, value in reference.arrays.items()}
    cut.digests = {}
    return cut
