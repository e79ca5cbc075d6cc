"""The late window: a divergence that starts after a clean step 0, judged where it starts.

Later norms cannot tell a wrong update from wrong gradients, so this stack resumes from the reference's own late
checkpoint (step S) in a fresh process, recomputes step S's gradients and trains on; what each outcome convicts
is docs/triage.md's late-window table. A bug needing a warmed-up process does not recur there. torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..scenarios.shared.late_gradients import METRIC as LATE_GRAD
from . import LATE_WINDOW as NAME
from . import Experiment
from .decision import first_step as earliest
from .naming import sparse

if TYPE_CHECKING:
    from ..comparison.compare import Comparison

LOAD_METRICS = ("resume_load", "resume_state")
# The window's step whose loss first shows the update of step S (the window counts from S: its step 0 is S's own
# loss, from the reference's weights). A window that leaves its limits only later may follow a later step's gradients,
# which the reference does not keep (a kernel wrong on one batch only), or a bug that needs a warmed-up process (one
# device's core after N calls), as much as an update whose error grows over a few steps (a learning rate 0.1% off
# crosses its tolerant limit at the window's step 5; in the exact lane its bits move at step 1): that convicts nothing,
# unless the run itself diverged from its own first update on.
UPDATE_SHOWS = 1


def judged(first_step: int, saved_step: int, window: Comparison, compared: bool = True) -> Experiment:
    """What the continuation from the reference's step-``saved_step`` checkpoint says of a divergence that
    starts at ``first_step``. ``compared``: both sides kept step S's gradients (a reference recorded before
    late gradients were kept has none, and then nothing was compared)."""
    if not compared:
        return Experiment(NAME, "not applicable", "the reference keeps no gradients of its checkpoint's step "
                                                  "(recorded before they were kept): re-record it to have the window")
    load = window.finding(*LOAD_METRICS)
    if load is not None:  # the state is not the reference's: its gradients judge the load, not the divergence
        return Experiment(NAME, "not applicable", f"the reference's checkpoint did not load as saved on this stack "
                                                  f"({load.message}); the resume case judges the load")
    late = [f for f in window.findings if f.metric == LATE_GRAD]
    where = f"step {saved_step}'s gradients, computed on this stack from the reference's own state at step {saved_step}"
    if late:
        more = f" (and {len(late) - 1} more tensors)" if len(late) > 1 else ""
        # A few wrong elements are a collective's signature (a message's tail, one protocol's slot), as step 0's
        # findings are named; wrong nearly everywhere is a backward kernel or a collective that scales all it
        # carries, which one launch from the checkpoint cannot tell apart.
        return Experiment(NAME, "differs", f"{where}, differ from the reference's: {late[0].message}{more}",
                          component="collective" if sparse(late[0]) else "kernel or collective")
    if saved_step < first_step:
        return Experiment(NAME, "before the divergence", f"{where}, match the reference's, but the run diverges "
                                                         f"only at step {first_step}: this clears nothing")
    return _after(where, first_step, window)


def _after(where: str, first_step: int, window: Comparison) -> Experiment:
    """Step S's gradients match the reference's: what the window's steps after S say (its findings are theirs)."""
    if not window.findings:
        return Experiment(NAME, "did not reproduce", f"{where}, match the reference's, and so do the steps after it: "
                                                     f"the divergence (from step {first_step}) does not recur in a fresh "
                                                     "process resumed from the reference's state, as a bug that needs a "
                                                     "warmed-up process does not; this clears nothing")
    step = earliest(window)
    shown = UPDATE_SHOWS if step is None else step
    again = (f"{where}, match the reference's, and the steps after it diverge again in a fresh process "
             f"({window.findings[0].message})")
    if shown <= UPDATE_SHOWS:
        return Experiment(NAME, "reproduced", f"{again}: right gradients from right weights, so the weights go "
                                              "wrong in the update", component="optimizer")
    # Only in the tolerant lane, where a small error of the update crosses its limit late; in the exact lane the
    # update's bits move at the window's first step, and a run that moved at its step 1 may have had its gradients
    # move first (the update is then ruled out: triage/__init__.py).
    if first_step <= UPDATE_SHOWS and window.lane != "exact":
        return Experiment(NAME, "reproduced", f"{again}, from the window's step {shown}; the run itself diverged "
                                              f"from its first update on (step {first_step}, after a clean step 0): "
                                              "right gradients from right weights and a divergence from the first "
                                              "update, so the weights go wrong in the update", component="optimizer")
    return Experiment(NAME, "reproduced later", f"{again}, but only from the window's step {shown}: a later batch's "
                                                "gradients (which the reference does not keep), or a bug that needs "
                                                f"{shown} steps of warm-up in a process, could do this as much as "
                                                "an update a little off; this convicts nothing")

