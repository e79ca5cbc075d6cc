"""Data that changed under the model: the token batches a run trained on, against the reference's. numpy only.

Each training step's figures carry a digest of the global token batch it read (training/step.py: every rank's
batch digest, summed), kept as the series ``batch_digest``. Tokens are integers: they do not drift with a kernel
path, so any step whose digest differs trained on other data, and every number after it follows from that: the
finding is [data], whatever else moved. What made the batches (the synthetic chain, drawn with numpy, or the
user's token file) is named, with numpy's version where it moved, since a numpy routine that returns other
indices (searchsorted, a random stream) changes the batches without touching the model.
"""

from __future__ import annotations

from .record import RunRecord

BATCH_DIGEST = "batch_digest"


def first_changed_step(reference: RunRecord, run: RunRecord) -> int | None:
    """The first step whose token batch differs from the reference's; None where none does, or where either record
    keeps no batch digests (recorded before they were kept, or a loop that does not read through rank_tokens)."""
    ref, got = reference.series.get(BATCH_DIGEST), run.series.get(BATCH_DIGEST)
    if not ref or not got:
        return None
    return next((step for step, (a, b) in enumerate(zip(ref, got)) if a != b), None)


def producer(run: RunRecord, reference: RunRecord | None = None) -> str:
    """What made the run's token batches, with the version of the library that drew them where it is known."""
    if run.config.get("tokens"):
        return f"the token file {run.config['tokens']}"
    now = (run.fingerprint.get("versions") or {}).get("numpy")
    then = ((reference.fingerprint.get("versions") or {}).get("numpy") if reference is not None else None)
    numpy = f"numpy {then} -> {now}" if then and now and then != now else f"numpy {now or '(version unknown)'}"
    return f"the synthetic Markov chain of training/data.py, drawn with {numpy} (a counter-based hash, then " \
           f"numpy's searchsorted)"


def finding_text(reference: RunRecord, run: RunRecord, step: int) -> str:
    total = len(run.series.get(BATCH_DIGEST, []))
    changed = sum(1 for a, b in zip(reference.series.get(BATCH_DIGEST, []), run.series.get(BATCH_DIGEST, [])) if a != b)
    return (f"data: the token batch of step {step} differs from the reference's (its digest), {changed} of {total} "
            f"steps' batches do: the run trained on other data, and every difference after it follows from that; "
            f"the batches come from {producer(run, reference)}")
