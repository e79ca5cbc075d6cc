"""Metrics produced anywhere, as a record the plugin compares: ``gpuregress.check_metrics``. numpy only.

A job the plugin does not launch (a Megatron log, one's own torchrun job) gets a RunRecord of the built-in
scenarios' form, so the same lanes, reports and plots judge it; ``rtol`` forces the tolerant lane with those
limits. The accepted fields: docs/own-models.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..reference.names import safe_component
from ..reference.record import RunRecord, float_digest
from .compare import DEFAULT_TOLERANCES, Tolerances

TOLERANCE_KEYS = ("loss", "grad_norm", "clipped_grad_norm", "param_grad_norm", "final_weights")
Values = Sequence[float] | np.ndarray


def metrics_record(name: str, *, platform_key: str, fingerprint: dict[str, Any], loss: Values,
                   grad_norm: Values | None = None, clipped_grad_norm: Values | None = None,
                   param_grad_norms: Mapping[str, Values] | None = None,
                   tensors: Mapping[str, Any] | None = None) -> RunRecord:
    """The record of one job's metrics; ValueError naming the argument where one is not what it must be."""
    safe_component(name, "check_metrics name (it names the reference folder)")
    steps = _series("loss", loss)
    if not steps:
        raise ValueError("check_metrics: loss is empty: give one value per step")
    series = {"loss": steps}
    for key, values in (("grad_norm", grad_norm), ("clipped_grad_norm", clipped_grad_norm)):
        if values is not None:
            series[key] = _series(key, values, len(steps))
    arrays: dict[str, np.ndarray] = {}
    names: list[str] = []
    if param_grad_norms:
        names = list(param_grad_norms)
        arrays["param_grad_norm"] = np.stack([np.asarray(_series(f"param_grad_norms[{n!r}]", param_grad_norms[n],
                                                                 len(steps))) for n in names], axis=1)
    digests = {n: float_digest(np.asarray(v)) for n, v in (tensors or {}).items()}
    return RunRecord(scenario=name, config={"metrics": "check_metrics"}, platform_key=platform_key, world_size=1,
                     fingerprint=fingerprint, series=series, param_names=names, arrays=arrays, digests=digests)


def tolerances(rtol: float | Mapping[str, float] | None) -> Tolerances | None:
    """Explicit limits from ``rtol`` (None: none given); a metric not named keeps the fp32 default."""
    if rtol is None:
        return None
    given = dict.fromkeys(TOLERANCE_KEYS, rtol) if isinstance(rtol, (int, float)) else dict(rtol)
    unknown = sorted(set(given) - set(TOLERANCE_KEYS))
    if unknown:
        raise ValueError(f"check_metrics: rtol names {', '.join(unknown)}, which are not metrics; known: "
                         f"{', '.join(TOLERANCE_KEYS)}")
    if any(not (isinstance(v, (int, float)) and v >= 0) for v in given.values()):
        raise ValueError(f"check_metrics: rtol must be numbers >= 0, got {given}")
    base = vars(DEFAULT_TOLERANCES["fp32"])
    return Tolerances(**{**base, **{k: float(v) for k, v in given.items()}})


def _series(what: str, values: Values, steps: int | None = None) -> list[float]:
    out = [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]
    if steps is not None and len(out) != steps:
        raise ValueError(f"check_metrics: {what} has {len(out)} values, loss has {steps}: give one per step")
    if not all(np.isfinite(out)):
        raise ValueError(f"check_metrics: {what} holds a value that is not finite")
    return out
