"""Data that changed under the model: the token batches a run trained on, against the reference's. numpy only.

Tokens do not drift with a kernel path, so a step whose ``batch_digest`` differs trained on other data and the
finding is [data], whatever else moved; per-stream digests (``stream:<name>``) name the random stream that
shifted. numpy's version is named where it moved: its routines make the batches.
"""

from __future__ import annotations

from ..reference.record import RunRecord

BATCH_DIGEST = "batch_digest"
STREAM_PREFIX = "stream:"
# What each stream a data pipeline keeps a digest of is, and the package whose version it follows.
TOKEN_SOURCE = "tokens"  # the stream of the tokens themselves, before any random draw: named by producer()
STREAMS: dict[str, tuple[str, str]] = {
    TOKEN_SOURCE: ("the token source (the synthetic chain or the token file)", "numpy"),
    "python": ("Python's random generator (the order of the batch's rows)", "python"),
    "numpy": ("numpy's random generator (the crop's offset)", "numpy"),
    "torch_cpu": ("torch's CPU generator (which input tokens are replaced, and by what)", "torch"),
    "device": ("torch's generator on the device (which labels are dropped)", "torch"),
}


def stream_series(draws: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per-step stream digests (one dict per step) as the record's series ``stream:<name>``."""
    names = list(draws[0]) if draws else []
    return {STREAM_PREFIX + name: [float(step[name]) for step in draws] for name in names}


def stream_changes(reference: RunRecord, run: RunRecord) -> list[tuple[str, int]]:
    """(stream, first step it drew other numbers) for every stream both records keep, earliest first."""
    out = []
    for key, ref in reference.series.items():
        got = run.series.get(key)
        if key.startswith(STREAM_PREFIX) and got:
            step = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            if step is not None:
                out.append((key[len(STREAM_PREFIX):], step))
    order = list(STREAMS)  # at one step, in the order the pipeline draws them
    return sorted(out, key=lambda change: (change[1], order.index(change[0]) if change[0] in order else len(order)))


def _versions(reference: RunRecord | None, run: RunRecord, package: str) -> tuple[str | None, str | None]:
    """(the reference's, the run's) version of ``package``, from their fingerprints; None where unknown."""
    then = (reference.fingerprint.get("versions") or {}).get(package) if reference is not None else None
    return then, (run.fingerprint.get("versions") or {}).get(package)


def _version_change(reference: RunRecord, run: RunRecord, package: str) -> str:
    then, now = _versions(reference, run, package)
    return f", {package} {then} -> {now}" if then and now and then != now else ""


def describe_streams(reference: RunRecord, run: RunRecord, changes: list[tuple[str, int]]) -> str:
    """The streams that moved, in words: what each is, from which step, and its package's version change."""
    parts = []
    for name, step in changes:
        what, package = STREAMS.get(name, (f"the stream {name!r}", ""))
        parts.append(f"{what} from step {step}{_version_change(reference, run, package) if package else ''}")
    return "; ".join(parts)


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
    then, now = _versions(reference, run, "numpy")
    numpy = f"numpy {then} -> {now}" if then and now and then != now else f"numpy {now or '(version unknown)'}"
    return f"the synthetic Markov chain of training/data.py, drawn with {numpy} (a counter-based hash, then " \
           f"numpy's searchsorted)"


def finding_text(reference: RunRecord, run: RunRecord, step: int) -> str:
    total = len(run.series.get(BATCH_DIGEST, []))
    changed = sum(1 for a, b in zip(reference.series.get(BATCH_DIGEST, []), run.series.get(BATCH_DIGEST, [])) if a != b)
    head = (f"data: the token batch of step {step} differs from the reference's (its digest), {changed} of {total} "
            f"steps' batches do: the run trained on other data, and every difference after it follows from that")
    return f"{head}; {_cause(reference, run)}"


def _cause(reference: RunRecord, run: RunRecord) -> str:
    """What made the batches differ: the tokens themselves, the pipeline's random streams, or neither of those."""
    streams = stream_changes(reference, run)
    source = next((step for name, step in streams if name == TOKEN_SOURCE), None)
    random = [(name, step) for name, step in streams if name != TOKEN_SOURCE]
    parts = [f"the tokens themselves differ from step {source}: they come from {producer(run, reference)}"] \
        if source is not None else []
    if random:
        parts.append(f"the data pipeline's random streams drew other numbers: {describe_streams(reference, run, random)}")
    if parts:
        return "; ".join(parts)
    if any(key.startswith(STREAM_PREFIX) for key in run.series):
        return ("every random stream rank 0 keeps drew the same numbers: the pipeline's own code changed, or "
                "another rank's draws did")
    return f"the batches come from {producer(run, reference)}"
