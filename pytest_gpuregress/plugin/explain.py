"""Triage's experiments used by the session: on a failed comparison, to convict a component in place of the
heuristic's guess; on a recording, the float64 oracle's distance stored with the reference."""

from __future__ import annotations

from ..reference.compare import Comparison
from ..reference.record import RunRecord
from ..scenarios import Scenario, Setup
from .launches import Runner


def explain_failure(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, comparison: Comparison,
                    model: str | None, flips: bool) -> tuple[str | None, list[str]]:
    """(the component behind a failed comparison, report lines with the evidence): equivalence and the oracle
    always, switches flipped with ``flips`` (--gpuregress-triage)."""
    from .. import triage
    from ..reference import model_layout
    from ..triage.flips import flip

    model_changed = any(f.component == model_layout.COMPONENT for f in comparison.findings)
    try:
        # Equivalence and the oracle need no reference: even where the model's code changed, they can
        # still convict a collective or a kernel of this stack, which re-recording must not bury.
        experiments = triage.cheap_evidence(sc, setup, run, model)
        if model_changed and not any(e.convicts for e in experiments):
            return model_layout.COMPONENT, ["", "triage verdict: model. Evidence: the model's parameter layout "
                                            "differs from the reference's, so the runs start from other weights; "
                                            "equivalence and the oracle on this stack convict nothing",
                                            *triage.report("", experiments)[2:]]
        if flips and not model_changed:  # flips compare with a reference that cannot judge
            experiments += flip(sc, setup, run, reference, comparison, model)
    except Exception as exc:  # noqa: BLE001 - triage must never hide the regression it explains
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return None, ["", f"triage could not run ({type(exc).__name__}: {first}); components are the heuristic's"]
    component, line = triage.verdict(comparison, experiments)
    keep_first_moved_stack(sc, setup, run, comparison, model, rerun=flips)
    return component, triage.report(line, experiments)


def keep_first_moved_stack(sc: Scenario, setup: Setup, run: Runner, comparison: Comparison, model: str | None,
                           rerun: bool) -> None:
    """The Python stack of the first op that moved, from step 0 re-run on this stack (``rerun``: with
    --gpuregress-triage, whose launches it joins), into the comparison's report; else how to get it."""
    from ..triage.op_stack import keep_stack

    moved = comparison.culprit
    if moved is None or moved.kind != "moved":
        return
    if not rerun:
        moved.stack.append("its Python stack: add --gpuregress-triage, which re-runs step 0 to keep it")
        return
    try:
        moved.stack.extend(keep_stack(sc, setup, run, moved, model))
    except Exception as exc:  # noqa: BLE001 - a stack is a help for the bug report, never worth losing the failure
        moved.stack.append(f"its Python stack: the re-run of step 0 failed ({type(exc).__name__}: {exc})")


def measure_oracle_distance(sc: Scenario, setup: Setup, run: Runner, record: RunRecord, model: str | None) -> None:
    """Store ``record``'s step-0 distance from triage's float64 oracle in it (reference/oracle_distance.py)."""
    from .. import triage
    from ..reference import oracle_distance

    oracle = sc.oracle_launch(setup, model)
    if oracle is None and sc.supports_triage:
        oracle = triage.launches(sc, setup, model)["oracle"]
    # Cases sharing one launch: measured once.
    if oracle is not None and record.results.get(oracle_distance.RESULT_KEY) is None:
        oracle_distance.attach(record, run(sc, oracle))
