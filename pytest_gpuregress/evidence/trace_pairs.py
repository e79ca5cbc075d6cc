"""Two step-0 op traces of one rank paired op by op, across a changed op sequence. numpy only.

Upgrades insert, move and fuse ops; paired by position, everything after the first change would go unjudged.
So ops pair first by whole identity (longest equal runs, as difflib aligns text), then by what they compute
with the module as a soft key (a relabelled op). Unpaired stretches become one short note per kind of change.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Literal

from .op_trace import INPUT_OP, ROOT, RankTrace, TraceOp

# Above this share of a trace's entries unpaired, the note says the pairing covers only part of step 0.
MOSTLY_UNPAIRED = 0.25
_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
_NOTES_SHOWN = 6
_OPS_NAMED = 3
StretchKind = Literal["inserted", "removed", "replaced"]


@dataclass(frozen=True)
class Stretch:
    """Entries of the reference (``ref``) and of this run (``run``) that could not be paired one to one."""

    kind: StretchKind
    ref: range
    run: range


@dataclass
class Pairing:
    """One rank's two traces, op by op: the pairs (reference index, run index) in order, those pairs whose module
    label differs, and the stretches no pair covers."""

    pairs: list[tuple[int, int]]
    relabelled: list[tuple[int, int]]
    stretches: list[Stretch]
    ref_len: int
    run_len: int
    run_to_ref: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_to_ref = {j: i for i, j in self.pairs}

    @property
    def complete(self) -> bool:
        """Every entry of both traces is paired, under the same module label: the sequence did not change."""
        return not self.stretches and not self.relabelled and len(self.pairs) == self.ref_len == self.run_len

    @property
    def unpaired(self) -> int:
        """Entries of this run left without a partner."""
        return self.run_len - len(self.pairs)

    def first_change(self) -> int | None:
        """This run's index where the sequence first departs from the reference's (a stretch or a relabelled pair);
        the run's length where only the reference goes on; None where nothing changed."""
        starts = [s.run.start for s in self.stretches] + [j for _, j in self.relabelled]
        return min(starts) if starts else None


def _keys(trace: RankTrace, with_module: bool) -> list[tuple[str, ...]]:
    identities = (trace.entry(i).identity for i in range(len(trace)))  # (op, module, phase, inputs, *outputs)
    return [key if with_module else (key[0], *key[2:]) for key in identities]


def _matched(a: list[tuple[str, ...]], b: list[tuple[str, ...]]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes over two key lists (interned as ints: hashing tuples of strings once)."""
    table: dict[tuple[str, ...], int] = {}
    ints_a = [table.setdefault(k, len(table)) for k in a]
    ints_b = [table.setdefault(k, len(table)) for k in b]
    return SequenceMatcher(None, ints_a, ints_b, autojunk=False).get_opcodes()


def pair(reference: RankTrace, run: RankTrace) -> Pairing:
    """Pair two traces of one rank (see the module docstring)."""
    full_ref, full_run = _keys(reference, True), _keys(run, True)
    soft_ref, soft_run = _keys(reference, False), _keys(run, False)
    pairs: list[tuple[int, int]] = []
    relabelled: list[tuple[int, int]] = []
    stretches: list[Stretch] = []
    for tag, i1, i2, j1, j2 in _matched(full_ref, full_run):
        if tag == "equal":
            pairs += zip(range(i1, i2), range(j1, j2))
            continue
        for soft_tag, a1, a2, b1, b2 in _matched(soft_ref[i1:i2], soft_run[j1:j2]):
            ref, got = range(i1 + a1, i1 + a2), range(j1 + b1, j1 + b2)
            if soft_tag == "equal":
                pairs += zip(ref, got)
                relabelled += zip(ref, got)
            else:
                kind: StretchKind = "inserted" if not ref else "removed" if not got else "replaced"
                stretches.append(Stretch(kind, ref, got))
    pairs.sort(key=lambda p: p[1])
    return Pairing(pairs, relabelled, stretches, len(reference), len(run))


# --- the notes ---------------------------------------------------------------------------------------------------

def folded(module: str) -> str:
    """A module path with its layer numbers folded: model.layers.3.mlp -> model.layers.N.mlp."""
    return _LAYER_NUMBER.sub("N", module)


def _where(module: str) -> str:
    if module == ROOT:
        return "the root module"
    return f"`{folded(module)}`" if module else "no module"


def _ops(entries: list[TraceOp]) -> str:
    counts = Counter("an input" if e.op == INPUT_OP else e.op for e in entries)
    named = ", ".join(f"{op}" + (f" x{n}" if n > 1 else "") for op, n in counts.most_common(_OPS_NAMED))
    more = len(counts) - _OPS_NAMED
    return named + (f" and {more} other kinds" if more > 0 else "")


FIELDS = ("op", "module", "phase", "inputs", "outputs")


def differing_fields(ref: TraceOp, got: TraceOp) -> list[str]:
    """Each field that differs between two entries at one place, with both values: "outputs f32[8] -> f64[8]"."""
    out = []
    for name in FIELDS:
        a, b = getattr(ref, name), getattr(got, name)
        if a != b:
            show = (", ".join(a), ", ".join(b)) if name == "outputs" else (a or "-", b or "-")
            out.append(f"{name} {show[0]} -> {show[1]}")
    return out


def notes(pairing: Pairing, reference: RankTrace, run: RankTrace) -> list[str]:
    """What changed in the op sequence, one short note per kind of change and place (layers folded), most frequent
    first; empty where nothing did. The analysis pairs the ops around each change and goes on past it."""
    found = _changes(pairing, reference, run)
    lines = [f"{n} op {text[0]}" if n == 1 else f"{n} ops {text[1]}" for text, n in found.most_common(_NOTES_SHOWN)]
    hidden = len(found) - _NOTES_SHOWN
    if hidden > 0:
        lines.append(f"and {hidden} other changes")
    if pairing.run_len and pairing.unpaired / pairing.run_len > MOSTLY_UNPAIRED:
        lines.append(f"only {len(pairing.pairs)} of this run's {pairing.run_len} ops could be paired with the "
                     f"reference's: the analysis covers those")
    return lines


def _changes(pairing: Pairing, reference: RankTrace, run: RankTrace) -> Counter[tuple[str, str]]:
    """Each change as (singular, plural) of what follows its count, counted by the singular: relabelled ops first,
    then each stretch's, in order."""
    found: Counter[tuple[str, str]] = Counter()
    for i, j in pairing.relabelled:
        ref, got = reference.entry(i), run.entry(j)
        where = f"in {_where(got.module)} ({_where(ref.module)} in the reference)"
        found[(f"now runs {where}", f"now run {where}")] += 1
    for stretch in pairing.stretches:
        found.update(_stretch_changes([reference.entry(i) for i in stretch.ref], [run.entry(j) for j in stretch.run],
                                      replaced=stretch.kind == "replaced"))
    return found


def _stretch_changes(ref: list[TraceOp], got: list[TraceOp], *, replaced: bool) -> Counter[tuple[str, str]]:
    """One stretch's changes: op by op where as many ops replaced as many, else what is new and what is gone."""
    found: Counter[tuple[str, str]] = Counter()
    if replaced and len(ref) == len(got):
        for a, b in zip(ref, got):
            what = f"at the same place: {a.op} in {_where(a.module)} ({a.phase}): {'; '.join(differing_fields(a, b))}"
            found[(f"differs {what}", f"differ {what}")] += 1
        return found
    if got:
        what = f"new in {_where(got[0].module)} ({got[0].phase}): {_ops(got)}"
        found[(f"is {what}", f"are {what}")] += len(got)
    if ref:
        what = f"of the reference no longer {{}} in {_where(ref[0].module)} ({ref[0].phase}): {_ops(ref)}"
        found[(what.format("runs"), what.format("run"))] += len(ref)
    return found


def changed_code(pairing: Pairing, reference: RankTrace, run: RankTrace) -> list[str]:
    """The packages whose code runs the ops inserted, removed or replaced (not merely relabelled), first met first,
    torch last: torch's own ops (FSDP2's copies, a module of torch.nn) change along with what calls them, so it
    is named first only where it alone changed. [] for traces that do not keep them."""
    found: dict[str, None] = {}
    for stretch in pairing.stretches:
        entries = [run.entry(j) for j in stretch.run] + [reference.entry(i) for i in stretch.ref]
        for entry in entries:
            if entry.package and entry.op != INPUT_OP:
                found.setdefault(entry.package)
    return sorted(found, key=lambda package: package == "torch")


def _float_dtypes(entry: TraceOp) -> set[str]:
    """The floating dtypes an entry's outputs hold ("f32[8, 64]" -> "f32", "bf16"; an index's "i64" is none)."""
    return {dtype for dtype in (output.split("[", 1)[0] for output in entry.outputs if "[" in output)
            if dtype.startswith(("f", "bf", "tf"))}


def new_dtypes(pairing: Pairing, reference: RankTrace, run: RankTrace) -> list[str]:
    """The floating dtypes that ops inserted in step 0 compute in and that no op of the reference's step 0 did ("bf16" where an
    autocast now runs an fp32 model's matmuls in bfloat16): the model runs in another precision than it was
    recorded in, which no kernel's change does. [] where none."""
    seen = set().union(*(_float_dtypes(reference.entry(i)) for i in range(len(reference))))
    inserted = set().union(*(_float_dtypes(run.entry(j)) for stretch in pairing.stretches for j in stretch.run))
    return sorted(inserted - seen)


# Ops that are one implementation torch's dispatch picks among several for the same call (scaled_dot_product_attention's
# backends, cuDNN and oneDNN variants): where such an op came or went, the call above it may be unchanged.
BACKEND_OPS = ("aten::_scaled_dot_product_", "aten::_flash_attention", "aten::_efficient_attention",
               "aten::_cudnn_attention", "aten::cudnn_", "aten::miopen_", "aten::mkldnn_", "aten::_fused_sdp")


def swapped_backend(pairing: Pairing, reference: RankTrace, run: RankTrace) -> str | None:
    """The first op of BACKEND_OPS that was inserted, removed or replaced: torch chose another implementation of a
    call (an SDPA backend), which changes the op sequence under unchanged library code. None where none was."""
    for stretch in pairing.stretches:
        for entry in [reference.entry(i) for i in stretch.ref] + [run.entry(j) for j in stretch.run]:
            if entry.op.startswith(BACKEND_OPS):
                return entry.op
    return None
