"""Whether the code computes another function: the float64 oracle's step 0, kept with the reference. numpy only.

On a failing run the oracle runs again on this stack. In float64 a new kernel path or collective moves its
numbers by about 1e-15; a library that changed what the model computes moves them past ``CODE_CHANGE``,
which convicts the model's code, not a kernel under it (docs/triage.md, "The library component").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..reference.record import RunRecord
from . import step0

RESULT_KEY = "oracle_step0"  # in RunRecord.results: {"loss": float, "grads": {name: [sum, sum |x|, max |x|]},
#                                                   "mode": {"mode": ..., "not_float64": [...]}}
MODE_KEY = "oracle_mode"  # in an oracle's own record: which oracle it computed (training/oracle.py MODE)
# float64 step 0 moves ~1e-15 with the kernels (1.1e-15 between the shipped references' two CPUs); a library
# change that alters the math moves it past 1e-6 (RMSNorm's default epsilon for the config's: 4.2e-2). The
# oracle's gradients are kept in float32: 6e-8 per element.
CODE_CHANGE = 1e-6
METRIC = "step0_oracle"  # the comparison's finding where the kept oracles differ (kept_change)


@dataclass(frozen=True)
class CodeChange:
    """The oracle on this stack against the reference's: its largest relative move, and where."""

    tensor: str  # the parameter whose gradient moved most ("loss" where the loss moved more)
    relative: float
    moved: int  # parameters whose gradient moved past CODE_CHANGE
    total: int
    loss_relative: float = 0.0  # the loss's own move: the model's forward changed, not only an adapter's scaling

    def describe(self) -> str:
        where = "the loss" if self.tensor == "loss" else f"the gradient of {self.tensor}"
        return (f"the float64 oracle's step 0 on this stack differs from the one recorded with the reference: "
                f"{where} by {self.relative:.2g} relative, {self.moved} of {self.total} gradients past "
                f"{CODE_CHANGE:g}; float64 kernels move it by about 1e-15, so the code computes another function")


def digest(oracle: RunRecord) -> dict[str, Any]:
    """The oracle's step-0 loss and per-parameter gradient digests, and the mode it computed them in, as a
    reference keeps them."""
    grads = {name: step0.totals(prefix, values) for name, prefix, values in step0.each(oracle)}
    losses = oracle.series.get("loss") or [float("nan")]
    return {"loss": float(losses[0]), "grads": grads, "mode": oracle.results.get(MODE_KEY)}


def attach(record: RunRecord, oracle: RunRecord) -> None:
    """Keep ``oracle``'s step 0 in ``record`` (a recording about to become a reference)."""
    record.results[RESULT_KEY] = digest(oracle)


def _relative(now: list[float], then: list[float]) -> float:
    """The largest move of a digest [sum, sum |x|, max |x|]: the sums over sum |x|, max |x| over itself."""
    scales = (float(then[1]), float(then[1]), float(then[2]))
    moves = [abs(a - float(b)) / scale if scale else abs(a - float(b)) for a, b, scale in zip(now, then, scales)]
    return float(np.nan_to_num(max(moves), nan=np.inf))


def code_change(reference: RunRecord, oracle: RunRecord) -> CodeChange | None:
    """How the oracle's step 0 on this stack moved from the reference's, where it moved past ``CODE_CHANGE``;
    None where it did not, where the reference keeps none (recorded before it was kept), or where the
    parameters differ (another layout: evidence/model_layout.py names that)."""
    return _moved(reference.results.get(RESULT_KEY), digest(oracle))


def kept_change(reference: RunRecord, run: RunRecord) -> CodeChange | None:
    """``code_change`` from what both records keep: a run compared with its float64 distance measured (a bf16 run)
    keeps its oracle's step 0 as a reference does. None where either keeps none, or their oracles are computed in
    other modes (which ops escaped float64 may differ: that is the code's change, not the oracle's)."""
    kept, now = reference.results.get(RESULT_KEY), run.results.get(RESULT_KEY)
    if not isinstance(now, dict) or mode_of(kept) is None or mode_of(kept) != mode_of(now):
        return None
    return _moved(kept, now)


def mode_of(kept: Any) -> str | None:
    """The mode a kept oracle step 0 was computed in (training/oracle.py MODE); None where none is kept."""
    return ((kept.get("mode") or {}).get("mode")) if isinstance(kept, dict) else None


def _moved(kept: Any, now: dict[str, Any]) -> CodeChange | None:
    if not isinstance(kept, dict) or not isinstance(kept.get("grads"), dict):
        return None
    if set(now["grads"]) != set(kept["grads"]) or not now["grads"]:
        return None
    moves = {name: _relative(now["grads"][name], kept["grads"][name]) for name in now["grads"]}
    moves_loss = _loss_move(float(now["loss"]), float(kept.get("loss", float("nan"))))
    worst = max(moves, key=lambda name: moves[name])
    tensor, relative = (worst, moves[worst]) if moves[worst] >= moves_loss else ("loss", moves_loss)
    if not relative > CODE_CHANGE:
        return None
    return CodeChange(tensor, relative, sum(1 for m in moves.values() if m > CODE_CHANGE), len(moves), moves_loss)


def _loss_move(now: float, then: float) -> float:
    """The loss's relative move; inf where one of the two is NaN (a NaN must not hide the gradients' move)."""
    if np.isnan(now) or np.isnan(then):
        return 0.0 if np.isnan(now) and np.isnan(then) else float("inf")
    return abs(now - then) / abs(then) if then else abs(now)
