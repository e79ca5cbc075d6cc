"""Session side: the verdict on a resume from a reference's own checkpoint (fsdp-resume, lora's resume cases).

In order: the load piece by piece (a checkpoint is a copy: equal on every stack), the late gradients
(late_gradients.py), then the curve against the reference's last steps. Where the load broke, every deviation
of the curve follows from it (a fact triage names). torch-free (numpy).
"""

from __future__ import annotations

from typing import Any

from ...comparison.compare import Comparison, Finding, choose_lane, compare_training
from ...comparison.continuation import from_step
from ...reference.record import RunRecord
from ...stack import fingerprint as fp
from . import late_gradients
from .state_pieces import differing

SAVED_KEY = "resume_checkpoint"  # the reference's results: the step, the digests of the state saved, its size
LOADED_KEY = "resume"  # the continuation's results (rank side: resume_roles.RESULT_KEY)
CONTINUES_FROM = "continues_from"  # a continuation_reference's results: the step it starts at


def load_findings(saved: dict[str, Any], loaded: dict[str, Any]) -> list[Finding]:
    """Each piece of state that the load on this stack did not give back as the reference saved it."""
    if loaded.get("load_error"):
        return [Finding("resume_load", f"resume: loading the reference's checkpoint (step {saved['step']}) "
                        f"on this stack failed: {loaded['load_error']}")]
    if int(loaded.get("step", -1)) != int(saved["step"]):
        return [Finding("resume_load", f"resume: the loaded checkpoint says step {loaded.get('step')}, the "
                        f"reference saved it at step {saved['step']}")]
    return [Finding("resume_state", f"resume: {piece} after loading the reference's checkpoint is not the "
                    f"state it saved at step {saved['step']} ({why})", step=int(saved["step"]), tensor=piece)
            for piece, why in differing(saved["boundary"], loaded.get("boundary", {}))]


def continuation_reference(reference: RunRecord) -> RunRecord:
    """The reference from its checkpoint's step on, with the digests of what it saved: what a continuation is
    judged, plotted and kept against. Idempotent; a reference without a checkpoint is returned as it is."""
    saved = reference.results.get(SAVED_KEY)
    if not saved or reference.results.get(CONTINUES_FROM) is not None:
        return reference
    view = from_step(reference, int(saved["step"]))
    view.arrays.update(late_gradients.late_arrays(reference))
    if late_gradients.ENVELOPE in reference.arrays:
        view.arrays[late_gradients.ENVELOPE] = reference.arrays[late_gradients.ENVELOPE]
    view.results = {SAVED_KEY: saved, CONTINUES_FROM: int(saved["step"])}
    return view


def compare(reference: RunRecord, run: RunRecord, lane: str) -> Comparison:
    """The load piece by piece, then the continuation against the reference's last steps (``reference``: the whole
    reference or its ``continuation_reference``)."""
    reference = continuation_reference(reference)
    saved, loaded = reference.results.get(SAVED_KEY), run.results.get(LOADED_KEY, {})
    chosen, reason = choose_lane(reference, run, lane)
    if not saved:  # the session skips such a case; a kept run judged again by hand lands here
        return Comparison(chosen, reason, [Finding("resume_load", "resume: the reference has no resume "
                                                   "checkpoint to judge a continuation by: re-record it")],
                          fp.diff(reference.fingerprint, run.fingerprint))
    broken = load_findings(saved, loaded)
    if loaded.get("load_error"):
        return Comparison(chosen, reason, broken, fp.diff(reference.fingerprint, run.fingerprint))
    # Step S's gradients in step 0's place: a continuation has no step 0, and they are judged as step 0's are.
    comparison = compare_training(late_gradients.as_step0(reference), late_gradients.as_step0(run), lane=lane)
    start = int(saved["step"])
    late_margin = comparison.margins.pop("step0_grad", None)
    if late_gradients.has_late(reference):
        comparison.margins = {late_gradients.METRIC: late_margin or 0.0, **comparison.margins}
    for finding in comparison.findings:
        if finding.metric == "step0_grad":
            finding.metric, finding.step = late_gradients.METRIC, start
            finding.message = finding.message.replace(
                "step0_grad ", f"{late_gradients.METRIC} (step {start}'s gradients, from the reference's state) ", 1)
        else:
            finding.message = f"resumed at step {start} (steps counted from there): {finding.message}"
        if broken:  # the state the continuation started from was wrong: what follows is the load's doing
            finding.facts["after_broken_load"] = True
    if broken:  # one tensor's gradients say the load moved them; the other tensors' say the same again
        late = [f for f in comparison.findings if f.metric == late_gradients.METRIC]
        comparison.findings = [f for f in comparison.findings if f.metric != late_gradients.METRIC or f is late[0]]
        if len(late) > 1:
            late[0].message += f" (and {len(late) - 1} more tensors)"
    comparison.findings[:0] = broken
    return comparison
