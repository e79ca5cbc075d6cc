"""The model's code as evidence: the float64 oracle on this stack against the one kept with the reference.

Where the oracle computes another step 0 (evidence/oracle_step0.py), the code computes another function;
which code is named from what moved in the step-0 trace, then from the versions that changed. torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..evidence import oracle_step0
from ..evidence.model_layout import MODEL_LIBRARIES
from ..evidence.oracle_step0 import CODE_CHANGE, CodeChange
from ..reference.record import RunRecord
from ..training.oracle import MODE
from . import Experiment, Runner
from .decision import MODEL_CODE, Evidence
from .naming import op_component

if TYPE_CHECKING:
    from ..comparison.compare import Comparison
    from ..evidence.first_moved import FirstMoved
    from ..scenarios.base import Launch, Scenario, Setup


def experiment(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, model: str | None,
               comparison: Comparison | None = None) -> Experiment | None:
    """The oracle's evidence where it moved: the library (or kernel) ``suspect`` names. None where the oracle did
    not move, or where the scenario has no oracle."""
    from ..stack.fingerprint import installed_version

    launch = oracle_launch(sc, setup, model)
    kept = reference.results.get(oracle_step0.RESULT_KEY)
    if launch is None or oracle_step0.mode_of(kept) != MODE:
        return None  # no oracle, or another one than this plugin computes: its change would be the oracle's own
    try:
        change = oracle_step0.code_change(reference, run(sc, launch))
    except Exception:  # noqa: BLE001 - the experiments run the oracle again, and say why it failed
        return None
    if change is None:
        return None
    recorded = reference.fingerprint.get("versions") or {}
    evidence = Evidence(comparison)  # its culprit: none where too little of step 0 was paired to look for it
    component, why = suspect(change, recorded, {p: installed_version(p) for p in recorded}, evidence.culprit,
                             evidence.compared.changed_code)
    return Experiment(MODEL_CODE, "differs", f"{change.describe()}; {why}", component=component)


def oracle_launch(sc: Scenario, setup: Setup, model: str | None) -> Launch | None:
    """The float64 oracle of a scenario's step 0: its own, or triage's; None where it has none."""
    from . import launches

    own = sc.oracle_launch(setup, model)
    if own is not None or sc.triage is None:
        return own
    return launches(sc, setup, model)["oracle"]


# The libraries the float64 oracle runs: the model's code and LoRA's (accelerate only wraps the training runs).
ORACLE_LIBRARIES = ("transformers", "peft")


def suspect(change: CodeChange, recorded: dict[str, str | None], installed: dict[str, str | None],
            culprit: FirstMoved | None = None, changed_code: Sequence[str] = ()) -> tuple[str, str]:
    """(the component the moved oracle points at, why): the op that introduced it (its caller, or its kernel), else
    the package whose ops were inserted or removed, else the gradients that moved and the changed versions."""
    site = culprit.site if culprit is not None else None
    if culprit is not None and site == "called otherwise":
        return str(op_component(culprit)), culprit.describe()
    if culprit is not None and site == "compute":
        return "kernel", f"the op that introduced it had the reference's inputs and arguments and gave another " \
                         f"answer ({culprit.describe()}): its kernel computes another function, in float64 too"
    code = [p for p in changed_code if p]
    if code:
        return f"library: {code[0]}", f"step 0's op sequence changed in {code[0]}'s code (ops inserted, removed or " \
                                      f"replaced there{'; also in ' + ', '.join(code[1:]) if code[1:] else ''})"
    package, why = _by_version(change, recorded, installed)
    return f"library: {package}", why


def _by_version(change: CodeChange, recorded: dict[str, str | None],
                installed: dict[str, str | None]) -> tuple[str, str]:
    """The library where no op says which: by the gradients that moved, a changed version breaking the tie; torch
    where only torch changed (its ops compute another function, or its float64 kernels broke). Where none changed,
    the code on this machine did."""
    changed = _changed(recorded, installed)
    adapter_only = ".lora_" in change.tensor and not change.loss_relative > CODE_CHANGE
    by_code = "peft" if adapter_only else "transformers"
    # The gradients' library where it changed, else the other library the oracle runs, else torch, where changed.
    package = next((p for p in (by_code, *ORACLE_LIBRARIES, "torch") if p in changed), by_code)
    also = f" (torch changed too: {recorded['torch']} -> {installed['torch']})" \
        if package != "torch" and "torch" in changed else ""
    if package in changed:
        return package, f"{package} changed since the reference ({recorded[package]} -> {installed[package]}): " \
                        f"read its release notes{also}"
    return package, f"{package} is at the reference's version ({installed.get(package) or 'unknown'}): its code on " \
                    f"this machine was changed or patched, or torch's under it (the oracle runs both; no version " \
                    f"says which){also}"


def _changed(recorded: dict[str, str | None], installed: dict[str, str | None]) -> list[str]:
    """The libraries of the model's code whose version is known on both sides and changed since the reference."""
    return [p for p in MODEL_LIBRARIES if recorded.get(p) and installed.get(p) and recorded[p] != installed[p]]
