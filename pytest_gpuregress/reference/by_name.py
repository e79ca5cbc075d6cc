"""Per-parameter series paired by parameter name, never by position. numpy only.

A refactor that registers a layer's submodules in another order (same names, shapes and numbers) reorders
``param_grad_norm``'s columns; paired by position, every column would hold another parameter's norms.
"""

from __future__ import annotations

import numpy as np

from .record import RunRecord

KEY = "param_grad_norm"
REORDERED = ("this run registers the model's parameters in another order than the reference (the same names and "
             "shapes): the per-parameter series are compared by name (information)")


def param_grad_norms(reference: RunRecord, run: RunRecord) -> tuple[np.ndarray | None, str | None]:
    """``run``'s per-parameter gradient norms in ``reference``'s order of names, and a note where that differs; as
    they are where names cannot be paired (none, or others: a layout change the comparison reports itself)."""
    got = run.arrays.get(KEY)
    names, own = list(reference.param_names), list(run.param_names)
    if got is None or not names or names == own:
        return got, None
    where = {name: i for i, name in enumerate(own)}
    if len(where) != len(own) or sorted(own) != sorted(names) or got.ndim != 2 or got.shape[1] != len(own):
        return got, None
    return got[:, [where[name] for name in names]], REORDERED
