"""The first op that moved: where a run's step-0 op trace first departs from its reference's. numpy only.

Per rank the traces are paired (trace_pairs.py) and walked in this run's order; the first difference is a paired
op whose output bits differ (``moved``) or an unpaired or relabelled op (``sequence``: the exact lane stops there,
the tolerant lane walks on). Over ranks the earliest is named. docs/triage.md, "The first op that moved".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..reference.record import RunRecord
from .op_trace import COLLECTIVES, INPUT_OP, ROOT, RankTrace, TraceOp, ranks
from .trace_pairs import Pairing, differing_fields, pair

COLLECTIVE_NAMESPACES = (*COLLECTIVES, "fsdp::")


@dataclass(frozen=True)
class FirstMoved:
    rank: int
    kind: Literal["moved", "sequence"]  # an op's output moved, or the sequence of ops itself changed
    entry: TraceOp | None  # this run's entry; None where this run's trace ended first (a changed sequence)
    reference: TraceOp | None  # the reference's entry at that place
    equal_before: int  # ops before it, all bitwise equal (inputs not counted)
    relative: float  # for "moved": the digests' relative difference (0: only bits differ)
    world: int  # ranks compared
    also_on: tuple[int, ...] = ()  # other ranks where the same entry moved first
    stack: list[str] = field(default_factory=list)  # its Python stack, from the re-run that keeps it
    # What the line calls it: the first op that moved ("first difference"), or, in the tolerant lane, the op that
    # introduced a difference beyond drift ("introduced at", introduced.py) and where drift began ("drift begins at").
    label: str = "first difference"
    inputs_relative: float | None = None  # "introduced at": the most its inputs moved
    ulps: float | None = None  # "introduced at": its move in units of its output dtype's rounding
    # "introduced at" by its sketch (introduced.py): (the peak bucket's move in ulps, its ratio to the median's)
    spike: tuple[float, float] | None = None

    @property
    def arguments_changed(self) -> bool:
        """A moved op called with other non-tensor arguments than the reference's same op (both traces keep them):
        the code that called it changed, not the kernel under it. A view's strides alone do not count
        (``scalar_arguments``): the kernel or backend upstream chooses them, not the calling library."""
        if self.kind != "moved" or self.entry is None or self.reference is None:
            return False
        now, then = self.entry.arguments, self.reference.arguments
        return now is not None and then is not None and scalar_arguments(now) != scalar_arguments(then)

    @property
    def caller(self) -> str:
        """The package whose code ran the op ("" where the trace does not say)."""
        return (self.entry.package or "") if self.entry is not None else ""

    @property
    def site(self) -> str | None:
        """Where the op that moved sits, as a fact (triage/naming.py names the component): ``tokens`` (integers a step
        read), ``input`` (a weight or buffer), ``collective``, ``update`` (the clip and the optimizer step), ``called
        otherwise`` (other non-tensor arguments than the reference's), ``compute``; None for a changed sequence."""
        if self.kind != "moved" or self.entry is None:
            return None
        if self.entry.op == INPUT_OP:
            return "tokens" if holds_integers(self.entry) else "input"
        if self.entry.op.startswith(COLLECTIVE_NAMESPACES):
            return "collective"
        if self.entry.phase in ("clip", "optimizer"):  # gradient clipping is part of the update, as AdamW's step
            return "update"
        return "called otherwise" if self.arguments_changed else "compute"

    def describe(self) -> str:
        """One line: "first difference: aten::mm in model.layers.0.mlp.up_proj (forward), ... bitwise equal"."""
        if not self.arguments_changed:
            return self._describe()
        assert self.entry is not None and self.reference is not None
        whose = f"{self.caller}'s code" if self.caller else "the code that calls it"
        return f"{self._describe()}; it was called with other arguments: {self.reference.arguments or 'none'} in " \
               f"the reference, {self.entry.arguments or 'none'} now: {whose} calls it otherwise"

    def _describe(self) -> str:
        on = sorted((self.rank, *self.also_on))
        where = f"on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} of {self.world}"
        before = f"the {self.equal_before} ops before it are bitwise equal" if self.equal_before != 1 else \
            "the op before it is bitwise equal"
        if self.kind == "moved" and self.entry is not None:
            return f"{self.label}: {_name(self.entry)}, {_shapes(self.entry)}{self._how_it_moved(self.entry, before, where)}"
        if self.reference is not None and self.entry is not None:  # the same place: name what differs, both values
            what = f"{_name(self.reference)}: {'; '.join(differing_fields(self.reference, self.entry))}"
        else:
            ref = _name(self.reference) if self.reference is not None else "nothing more"
            got = _name(self.entry) if self.entry is not None else "nothing more"
            what = f"the reference ran {ref}, this run {got}"
        return f"the op sequence changed at op {self.entry_index}: {what} (the model's code or how torch " \
               f"dispatches it changed); {before} ({where}, step-0 op trace)"

    def _how_it_moved(self, entry: TraceOp, before: str, where: str) -> str:
        """How the op's output moved: integers (the data), a spike of a few elements, against its inputs, or alone."""
        if entry.op == INPUT_OP and holds_integers(entry):
            return ": integers the step read (its token batch) have other bits than the reference's, and integers " \
                   f"do not drift: the data changed ({where}, step-0 op trace)"
        if self.spike is not None:
            peak, ratio = self.spike
            median = f"{ratio:.3g}x the median bucket's" if ratio != float("inf") else "while most did not move"
            return f", a few of its output's elements moved: one bucket of its sketch by {peak:.3g} ulps, {median}, " \
                   f"and no input had such a bucket (the whole output moved {self.relative:.1e} relative; {where}, " \
                   "step-0 op trace)"
        if self.inputs_relative is not None:
            return f", its output moved {self.relative:.1e} relative ({self.ulps or 0:.3g} ulps) against " \
                   f"{self.inputs_relative:.1e} for its inputs ({where}, step-0 op trace)"
        size = f"{self.relative:.1e} relative" if self.relative > 0 else "bits differ, digests' sums equal"
        return f", {size}; {before} ({where}, step-0 op trace)"

    @property
    def entry_index(self) -> int:
        return (self.entry or self.reference).index  # type: ignore[union-attr]

    def lines(self) -> list[str]:
        """The report's lines: the description, and the stack where the re-run kept one."""
        return [self.describe(), *(f"    {line}" for line in self.stack)]


def holds_integers(entry: TraceOp) -> bool:
    """Every output of the entry is of an integer or boolean dtype (its shape text starts "i", "u" or "b")."""
    return bool(entry.outputs) and all(shape[:1] in ("i", "u", "b") and not shape.startswith("bf16")
                                       for shape in entry.outputs)


def _name(entry: TraceOp) -> str:
    region = f"; {entry.region}" if entry.region.startswith("FSDP::") else ""
    what = "an input" if entry.op == INPUT_OP else entry.op
    module = "the root module" if entry.module == ROOT else entry.module or "no module"
    return f"{what} in {module} ({entry.phase}{region})"


def _shapes(entry: TraceOp) -> str:
    outputs = ", ".join(entry.outputs)
    return f"{entry.inputs} -> {outputs}" if entry.inputs and entry.op != INPUT_OP else outputs


def bits_equal(a: TraceOp, b: TraceOp, compare_hashes: bool) -> bool:
    """Equal bits: equal hashes (an integer sum, the same in any order on any stack). Without hashes of one
    kind, equal float64 digests; those may also differ where only the summation order of the digest changed."""
    if compare_hashes:
        return np.array_equal(a.hashes, b.hashes)
    return np.array_equal(a.digests.view(np.int64), b.digests.view(np.int64))


def _changes(run: TraceOp, ref: TraceOp) -> np.ndarray:
    """Per output, the largest relative change of its digests, NaNs read as no change."""
    g, r = run.digests, ref.digests
    with np.errstate(divide="ignore", invalid="ignore"):
        change = np.abs(g - r)
        scale = np.stack([r[:, 1], r[:, 1], r[:, 2]], axis=1)
        rel = np.where(change == 0, 0.0, change / scale)
    return np.nan_to_num(rel, nan=0.0, posinf=np.inf).max(axis=1, initial=0.0)


def relative_per_output(run: TraceOp, ref: TraceOp) -> np.ndarray:
    """Per output, the largest relative change of its digests: |d sum| and |d sum of |x|| over the reference's
    sum of |x|, |d max |x|| over its max |x| (a uniform relative error e shows as e; one element off by d in n as
    about d / (n mean |x|)); inf where NaN appears in one digest and not the other."""
    nan_differs = np.isnan(run.digests).any(axis=1) != np.isnan(ref.digests).any(axis=1)
    return np.where(nan_differs, np.inf, _changes(run, ref))


def relative_difference(run: TraceOp, ref: TraceOp) -> float:
    """The largest relative change of the digests over every output; inf where NaN appears in one."""
    if np.isnan(run.digests).any() != np.isnan(ref.digests).any():
        return float("inf")
    return float(_changes(run, ref).max(initial=0.0))


Event = tuple[str, int, int | None, float]  # (kind, this run's index, the reference's index or None, relative)


def first_in_rank(reference: RankTrace, run: RankTrace, pairing: Pairing | None = None, *,
                  sequence: bool = True) -> Event | None:
    """The first entry, in this run's order, whose paired output's bits differ ("moved"), or, with ``sequence``,
    where the op sequence changed first ("sequence"), if that comes earlier; None when all agree."""
    pairing = pairing or pair(reference, run)
    compare_hashes = reference.hash_kind == run.hash_kind
    change = pairing.first_change() if sequence else None
    for i, j in pairing.pairs:
        if change is not None and j >= change:
            break
        ref, got = reference.entry(i), run.entry(j)
        if not bits_equal(ref, got, compare_hashes):
            return "moved", j, i, relative_difference(got, ref)
    if change is None:
        return None
    return "sequence", change, _reference_at(pairing, change), 0.0


def _reference_at(pairing: Pairing, index: int) -> int | None:
    """The reference's entry at this run's ``index``, where the sequence changed: its partner (a relabelled op), or
    the first of the stretch there, or where the reference goes on past this run's end."""
    if index in pairing.run_to_ref:
        return pairing.run_to_ref[index]
    for stretch in pairing.stretches:
        if stretch.run.start == index or (not stretch.run and index == pairing.run_len):
            return stretch.ref.start if stretch.ref else None
    return None


def pairings(reference: RunRecord, run: RunRecord) -> dict[int, tuple[RankTrace, RankTrace, Pairing]]:
    """Per rank both records traced: (the reference's trace, this run's, their pairing)."""
    ref_ranks, run_ranks = ranks(reference), ranks(run)
    return {r: (ref_ranks[r], run_ranks[r], pair(ref_ranks[r], run_ranks[r])) for r in sorted(set(ref_ranks) & set(run_ranks))}


def equal_traces(reference: RunRecord, run: RunRecord,
                 paired: dict[int, tuple[RankTrace, RankTrace, Pairing]] | None = None) -> tuple[int, int] | None:
    """(ranks, ops per rank) where both records traced step 0 and every op is bitwise equal; None otherwise."""
    paired = pairings(reference, run) if paired is None else paired
    if not paired or any(not p.complete or first_in_rank(ref, got, p) is not None for ref, got, p in paired.values()):
        return None
    return len(paired), min(len(got) for _, got, _ in paired.values())


def first_moved(reference: RunRecord, run: RunRecord, *, sequence: bool = True,
                paired: dict[int, tuple[RankTrace, RankTrace, Pairing]] | None = None) -> FirstMoved | None:
    """The first op of step 0 whose output moved, over every rank both records traced; None when every paired op
    is bitwise equal or either record has no trace. ``sequence``: a changed op sequence counts as the first
    difference too (the exact lane); without it, the first paired op that moved (the tolerant lane's drift)."""
    paired = pairings(reference, run) if paired is None else paired
    found = {r: first_in_rank(ref, got, p, sequence=sequence) for r, (ref, got, p) in paired.items()}
    moved = {r: f for r, f in found.items() if f is not None}
    if not moved:
        return None
    rank = min(moved, key=lambda r: (moved[r][1], r))
    kind, index, ref_index, relative = moved[rank]
    ref_trace, run_trace, _ = paired[rank]
    entry = run_trace.entry(index) if index < len(run_trace) else None
    ref_entry = ref_trace.entry(ref_index) if ref_index is not None else None
    before = sum(1 for i in range(index) if run_trace.entry(i).op != INPUT_OP)
    return FirstMoved(rank, kind, entry, ref_entry, before, relative, len(paired),  # type: ignore[arg-type]
                      _same_elsewhere(rank, entry, moved, paired))


def _same_elsewhere(rank: int, entry: TraceOp | None, moved: dict[int, Event],
                    paired: dict[int, tuple[RankTrace, RankTrace, Pairing]]) -> tuple[int, ...]:
    """The other ranks whose first difference is of the same kind at the same index, on the same op as ``entry``."""
    if entry is None:
        return ()
    kind, index = moved[rank][:2]
    return tuple(r for r, f in moved.items() if r != rank and f[:2] == (kind, index)
                 and index < len(paired[r][1]) and paired[r][1].entry(index).identity == entry.identity)


_VIEW_LAYOUT = re.compile(r"\b(\w+)@(\d+):\[[^\]]*\]")  # "self@4:[2048, 512, 8, 1]" (evidence/op_arguments.py)


def scalar_arguments(text: str) -> str:
    """An op's arguments as the calling code chose them: the scalars, flags and lists, and of each strided-view
    input only where in its storage it starts. Strides alone, and a view from the start of its storage, are left
    out: the kernel or backend upstream chooses a layout (a transposed SDPA output), while reading another part of
    a tensor (the odd features instead of the second half) is the caller's slicing."""
    def offset_only(found: re.Match[str]) -> str:
        return f"{found[1]}@{found[2]}" if found[2] != "0" else ""

    parts = (part.strip() for part in _VIEW_LAYOUT.sub(offset_only, text).split(", "))
    return ", ".join(part for part in parts if part)
