"""The op that introduced a difference, apart from the drift a new kernel path brings. numpy only.

An op introduced a difference when its output moved at least ``floor_ulps`` of its dtype's rounding and more than
``amplification`` times the most any of its inputs moved. The thresholds are measured (docs/envelope.md, "The op
that introduced a difference") and stored with the reference, so changing them never re-judges an old one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..reference.record import RunRecord
from .first_moved import COLLECTIVE_NAMESPACES, FirstMoved, bits_equal, pairings, relative_per_output
from .op_trace import COLLECTIVES, INPUT_OP, RESULT_KEY, RankTrace, TraceOp, ranks
from .trace_pairs import Pairing

INTRODUCED_KEY = "introduced"  # under results["op_trace"]: the thresholds the reference was recorded with
# Units of rounding per dtype (torch's abbreviations, as the trace's shape texts write them).
_EPSILON = {"f64": 2.0**-52, "f32": 2.0**-23, "tf32": 2.0**-10, "bf16": 2.0**-7, "f16": 2.0**-10,
            "f8e4m3fn": 2.0**-3, "f8e4m3fnuz": 2.0**-3, "f8e5m2": 2.0**-2, "f8e5m2fnuz": 2.0**-2}
_INTEGER_EPSILON = 1.0  # an integer output (indices, counts) that moved at all moved by whole units


@dataclass(frozen=True)
class Thresholds:
    floor_ulps: float
    amplification: float
    spike_ratio: float | None = None  # None: recorded before sketches were judged, so they are not
    spike_floor_ulps: float = 0.0  # a sketch's bucket moved at least this far, in ulps of a bucket's share

    def to_json(self) -> dict[str, float]:
        out = {"floor_ulps": self.floor_ulps, "amplification": self.amplification}
        return out if self.spike_ratio is None else \
            {**out, "spike_ratio": self.spike_ratio, "spike_floor_ulps": self.spike_floor_ulps}

    def describe(self) -> str:
        spike = "" if self.spike_ratio is None else \
            f", or, for a collective, a matmul or a copy, one bucket of its sketch moved at least " \
            f"{self.spike_floor_ulps:g} ulps and over {self.spike_ratio:g}x the median bucket's move while no " \
            f"input's sketch had such a bucket"
        return f"an output moved at least {self.floor_ulps:g} ulps of its dtype and over " \
               f"{self.amplification:g}x its inputs' move{spike}"


# Measured in docs/envelope.md ("The op that introduced a difference", "One wrong element through drift"): clean
# runs move no op past 6 ulps but AdamW's first update (89), nor past 3 ulps more than 10x its inputs'. The
# amplification sits far above that, since a heavy-tailed elementwise product amplifies a one-element error 190x
# and naming it would convict the wrong component. Spikes are judged only for ops that cannot turn dense input
# drift into one large move: collectives, matmuls and copies.
DEFAULT = Thresholds(floor_ulps=32.0, amplification=1000.0, spike_ratio=32.0, spike_floor_ulps=4.0)
FEW_BUCKETS = 8  # "a few elements": a bf16 AVG's 8-element tail (NVIDIA/nccl#1950) fills 8 buckets
INPUT_RELAX = 0.25  # an input's floor, against its output's: a reduce-scatter's input holds N times its elements
SPIKE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::mv",
             "aten::addmv", "aten::_grouped_mm", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat")


def stored_thresholds(reference: RunRecord) -> Thresholds | None:
    """The thresholds ``reference`` was recorded with; None for a reference recorded before they were kept."""
    stored = reference.results.get(RESULT_KEY)
    found = stored.get(INTRODUCED_KEY) if isinstance(stored, dict) else None
    if not isinstance(found, dict):
        return None
    try:
        spike = found.get("spike_ratio")
        return Thresholds(float(found["floor_ulps"]), float(found["amplification"]),
                          float(spike) if spike is not None else None, float(found.get("spike_floor_ulps", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None


def describe_thresholds(reference: RunRecord) -> str:
    found = stored_thresholds(reference)
    return found.describe() if found is not None else ""


def attach_thresholds(results: dict[str, Any]) -> None:
    """Store today's thresholds beside a recording's op trace (where it keeps one with sources)."""
    stored = results.get(RESULT_KEY)
    if isinstance(stored, dict):
        stored[INTRODUCED_KEY] = DEFAULT.to_json()


def epsilon(shape: str) -> float:
    """The unit of rounding of a shape text's dtype ("f32[8, 64]" -> 2**-23)."""
    dtype = shape.split("[", 1)[0]
    if dtype in _EPSILON:
        return _EPSILON[dtype]
    return _INTEGER_EPSILON if dtype[:1] in ("i", "u", "b") else _EPSILON["f32"]


@dataclass
class _Moves:
    """Per entry of this run's trace of one rank, how far each output moved (relative) from its partner in the
    reference's (trace_pairs.py), and each output's size and unit of rounding: its dtype's, or the coarsest its
    inputs' values were rounded to where that is coarser (values upcast from bf16 carry bf16's rounding into every
    float32 op they reach). An entry without a partner has no move of its own (None): what reads it is judged by
    its nearest paired ancestors' moves (``moved_outputs``), the rule this module chose for a changed sequence."""

    run: RankTrace
    outputs: list[np.ndarray | None]  # per entry: each output's relative move (0 where its bits are equal)
    sizes: list[np.ndarray]  # per entry: each output's elements
    epsilons: list[np.ndarray]  # per entry: each output's unit of rounding
    # per entry: each output's sketch buckets' moves (relative to a bucket's share of the output), None where an
    # output keeps no sketch in either trace or its bits are equal
    buckets: list[list[np.ndarray | None]] = field(default_factory=list)
    changed: list[bool] = field(default_factory=list)  # per entry: its bits differ from its partner's

    @classmethod
    def of(cls, reference: RankTrace, run: RankTrace, pairing: Pairing) -> _Moves:
        compare_hashes = reference.hash_kind == run.hash_kind
        moves = cls(run, [], [], [])
        for j in range(len(run)):
            got = run.entry(j)
            i = pairing.run_to_ref.get(j)
            if i is None:
                moves.outputs.append(None)
                moves.buckets.append([])
                moves.changed.append(False)
            else:
                ref = reference.entry(i)
                equal = bits_equal(ref, got, compare_hashes)
                moves.changed.append(not equal)
                moves.outputs.append(np.zeros(len(got.outputs)) if equal else relative_per_output(got, ref))
                moves.buckets.append([] if equal else bucket_moves(ref, got))
            moves.sizes.append(np.array([numel((s,)) for s in got.outputs], dtype=np.float64))
            moves.epsilons.append(moves._rounding(j, got))
        return moves

    def _rounding(self, index: int, entry: TraceOp) -> np.ndarray:
        """Each output's unit of rounding: its dtype's, or the coarsest its earlier inputs carry."""
        inherited = max((float(e) for k in self.run.sources_of(index) if k < index for e in self.epsilons[k] if e < 1.0),
                        default=0.0)  # floating inputs only: token ids round nothing
        return np.array([max(epsilon(s), inherited) for s in entry.outputs], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.outputs)

    def paired(self, index: int) -> bool:
        return self.outputs[index] is not None

    def relative(self, index: int) -> float:
        found = self.outputs[index]
        return float(found.max(initial=0.0)) if found is not None else 0.0

    def ulps(self, index: int) -> float:
        found = self.outputs[index]
        return float((found / self.epsilons[index]).max(initial=0.0)) if found is not None else 0.0

    def spikes(self, index: int, thresholds: Thresholds, relax: float = 1.0) -> list[tuple[float, float]]:
        """(peak bucket move, its ratio to the median bucket's) per output of entry ``index`` (an unpaired one: its
        nearest paired ancestors) whose sketch shows a few elements wrong amid drift: at most FEW_BUCKETS past the
        floor and ``spike_ratio`` x the median (a one-token change moves many). ``relax`` lowers the floor for an input."""
        if thresholds.spike_ratio is None:
            return []
        out = []
        for k in self.ancestors(index):
            for moved, eps in zip(self.buckets[k], self.epsilons[k]):
                if moved is None or not moved.size:
                    continue
                peak, base = float(moved.max()), float(np.median(moved))
                ratio = peak / base if base > 0 else float("inf")
                bar = max(thresholds.spike_floor_ulps * eps * relax, thresholds.spike_ratio * base)
                elevated = int(np.count_nonzero(moved >= bar / 2))
                if peak >= bar and elevated <= FEW_BUCKETS:
                    out.append((peak, ratio))
        return out

    def ancestors(self, index: int) -> list[int]:
        """``index`` itself where it has a partner; else its nearest paired ancestors, through its sources."""
        if self.outputs[index] is not None:
            return [index]
        found: list[int] = []
        seen = {index}
        todo = [k for k in self.run.sources_of(index) if k < index]
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            if self.outputs[k] is not None:
                found.append(k)
            else:
                todo += [m for m in self.run.sources_of(k) if m < k]
        return found

    def moved_outputs(self, index: int) -> list[tuple[float, float]]:
        """(relative move, elements) of each output of entry ``index`` that moved; for an entry without a partner,
        those of its nearest paired ancestors (followed through its sources)."""
        out: list[tuple[float, float]] = []
        for k in self.ancestors(index):
            found = self.outputs[k]
            assert found is not None
            out += [(float(r), float(n)) for r, n in zip(found, self.sizes[k]) if r > 0]
        return out


def bucket_moves(ref: TraceOp, got: TraceOp) -> list[np.ndarray | None]:
    """Per output, each sketch bucket's move over a bucket's share of the reference's sum of |x| (so a bucket is
    measured as the whole output is, in units of its dtype's rounding); None where either trace keeps no sketch."""
    out: list[np.ndarray | None] = []
    for k in range(len(got.outputs)):
        a = ref.sketches[k] if k < len(ref.sketches) else None
        b = got.sketches[k] if k < len(got.sketches) else None
        if a is None or b is None or a.shape != b.shape:
            out.append(None)
            continue
        share = max(float(ref.digests[k, 1]), float(np.finfo(np.float64).tiny)) / len(a)
        moved = np.abs(b - a) / share
        out.append(np.where(np.isnan(moved), np.inf, moved))
    return out


def numel(shapes: tuple[str, ...]) -> int:
    """Elements of the outputs whose shape texts are ``shapes`` ("f32[8, 64]" -> 512; "f32[]" -> 1)."""
    total = 0
    for shape in shapes:
        dims = shape[shape.index("[") + 1:shape.rindex("]")] if "[" in shape else ""
        total += int(np.prod([int(d) for d in dims.split(",") if d.strip()], dtype=np.int64))
    return max(total, 1)


def _input_sides(index: int, trace: RankTrace, moves: _Moves,
                 others: list[tuple[RankTrace, _Moves]]) -> list[tuple[RankTrace, _Moves]]:
    """The ranks whose inputs entry ``index`` read: its own; for a collective, also every rank whose trace holds the
    same collective at that place (ranks whose traces differ, as MoE routing makes them, are left out rather than
    paired with another op)."""
    entry = trace.entry(index)
    if not entry.op.startswith(COLLECTIVES):
        return [(trace, moves)]
    return [(trace, moves), *((other, other_moves) for other, other_moves in others
                              if index < len(other_moves) and other.entry(index).identity == entry.identity)]


def _inputs_moved(index: int, trace: RankTrace, moves: _Moves,
                  others: list[tuple[RankTrace, _Moves]]) -> list[tuple[float, float]]:
    """(relative move, elements) of every input of entry ``index`` that moved, on every rank it read from."""
    return [moved for rank_trace, rank_moves in _input_sides(index, trace, moves, others)
            for source in rank_trace.sources_of(index) if source < len(rank_moves)
            for moved in rank_moves.moved_outputs(source)]


def explained(inputs: list[tuple[float, float]], size: float) -> float:
    """The move an output of ``size`` elements may take from inputs that moved as ``inputs`` say. A digest
    spreads a change of a few elements over all of them, and a reduction (a norm, a sum) gathers it again into
    few outputs: so an input larger than the output explains its move times the ratio of their sizes."""
    return max((relative * max(1.0, elements / size) for relative, elements in inputs), default=0.0)


def _spiked(index: int, trace: RankTrace, moves: _Moves, others: list[tuple[RankTrace, _Moves]],
            thresholds: Thresholds) -> bool:
    """Whether entry ``index`` introduced a few wrong elements amid drift: an op that cannot make one large move of
    dense drift (SPIKE_OPS, collectives) whose sketch has a bucket far past the others, while no input's does (an
    input that came with one passed it on). A collective's inputs are every rank's that ran it."""
    op = trace.entry(index).op
    if not (op in SPIKE_OPS or op.startswith(COLLECTIVE_NAMESPACES)) or not moves.spikes(index, thresholds):
        return False
    return not any(rank_moves.spikes(source, thresholds, relax=INPUT_RELAX)
                   for rank_trace, rank_moves in _input_sides(index, trace, moves, others)
                   for source in rank_trace.sources_of(index) if source < len(rank_moves))


def _introduces(index: int, inputs: list[tuple[float, float]], moves: _Moves, thresholds: Thresholds) -> float | None:
    """What its inputs explain, where an output of entry ``index`` moved past the floor and more than
    ``amplification`` times that; None where no output did."""
    found = moves.outputs[index]
    for relative, size, eps in zip(found if found is not None else (), moves.sizes[index], moves.epsilons[index]):
        allowed = explained(inputs, size)
        if relative / eps >= thresholds.floor_ulps and relative > thresholds.amplification * allowed:
            return allowed
    return None


def _first_in_rank(trace: RankTrace, moves: _Moves, others: list[tuple[RankTrace, _Moves]],
                   thresholds: Thresholds) -> tuple[int, float] | None:
    """(entry index, what its inputs explain) of the first entry that introduced a difference, or None."""
    drifted = False
    # an entry without a partner in the reference has nothing to measure: what reads it is judged by its ancestors
    for index in filter(moves.paired, range(len(moves))):
        entry = trace.entry(index)
        # an output's epsilon is its dtype's where that is 1 or more (an input's coarser rounding is below 1)
        if entry.op == INPUT_OP and moves.changed[index] and (moves.epsilons[index] >= 1.0).all():
            return index, 0.0  # integers read from outside the trace (tokens) that changed: they never drift
        if _spiked(index, trace, moves, others, thresholds):  # a few elements wrong: the whole digest dilutes them
            return index, explained(_inputs_moved(index, trace, moves, others), float(moves.sizes[index].max()))
        if moves.ulps(index) < thresholds.floor_ulps:
            drifted |= moves.relative(index) > 0
            continue
        if entry.op == INPUT_OP:
            if not drifted:
                return index, 0.0  # a tensor no op made (tokens, weights) moved that far, before any op: the data
            continue  # made by what the trace does not see (a collective's wait) from values that drifted already
        allowed = _introduces(index, _inputs_moved(index, trace, moves, others), moves, thresholds)
        if allowed is not None:
            return index, allowed
    return None


@dataclass
class Traced:
    """Two records' step-0 traces set side by side: the reference's thresholds, each rank's trace, and how far each
    entry moved on the ranks both traced."""

    thresholds: Thresholds
    reference: dict[int, RankTrace]
    run: dict[int, RankTrace]
    moves: dict[int, _Moves]
    partners: dict[int, dict[int, int]] = field(default_factory=dict)  # per rank: this run's index -> the reference's

    @classmethod
    def of(cls, reference: RunRecord, run: RunRecord,
           paired: dict[int, tuple[RankTrace, RankTrace, Pairing]] | None = None) -> Traced | None:
        thresholds = stored_thresholds(reference)
        if thresholds is None or not analysed(reference, run):
            return None
        paired = pairings(reference, run) if paired is None else paired
        return cls(thresholds, {r: p[0] for r, p in paired.items()}, {r: p[1] for r, p in paired.items()},
                   {r: _Moves.of(*p) for r, p in paired.items()}, {r: p[2].run_to_ref for r, p in paired.items()})

    def others(self, rank: int) -> list[tuple[RankTrace, _Moves]]:
        """This run's trace and moves on every other rank both traced, in rank order."""
        return [(self.run[o], self.moves[o]) for o in sorted(self.moves) if o != rank]


def analysed(reference: RunRecord, run: RunRecord) -> bool:
    """Both records traced step 0 with sources on a rank they share, and the reference keeps its thresholds."""
    ref_ranks, run_ranks = ranks(reference), ranks(run)
    common = set(ref_ranks) & set(run_ranks)
    return stored_thresholds(reference) is not None and bool(common) and \
        all(ref_ranks[r].has_sources and run_ranks[r].has_sources for r in common)


def introduced_at(reference: RunRecord, run: RunRecord, traced: Traced | None = None) -> FirstMoved | None:
    """The first op of step 0 that introduced a difference beyond drift, over every rank (the earliest entry,
    the lowest rank on a tie); None where none did, or where ``analysed`` is false."""
    traced = traced or Traced.of(reference, run)  # ``traced``: set up already by the caller, who reuses it
    if traced is None:
        return None
    found = _first_per_rank(traced)
    if not found:
        return None
    rank = min(found, key=lambda r: (found[r][0], r))
    index, inputs = found[rank]
    trace, moves = traced.run[rank], traced.moves[rank]
    same = tuple(r for r, (i, _) in found.items() if r != rank and i == index)
    before = sum(1 for i in range(index) if trace.entry(i).op != INPUT_OP)
    partner = traced.reference[rank].entry(traced.partners[rank][index])
    return FirstMoved(rank, "moved", trace.entry(index), partner, before, moves.relative(index), len(traced.moves),
                      same, label="introduced at", inputs_relative=inputs, ulps=moves.ulps(index),
                      spike=_spike(index, moves, traced.thresholds))


def _first_per_rank(traced: Traced) -> dict[int, tuple[int, float]]:
    """Per rank, in rank order: (entry index, what its inputs explain) of its first entry that introduced a
    difference; ranks where none did are left out."""
    found = {}
    for rank in sorted(traced.moves):
        hit = _first_in_rank(traced.run[rank], traced.moves[rank], traced.others(rank), traced.thresholds)
        if hit is not None:
            found[rank] = hit
    return found


def _spike(index: int, moves: _Moves, thresholds: Thresholds) -> tuple[float, float] | None:
    """The largest spike of entry ``index``'s sketch, in units of its rounding, where its digest stayed within the
    floor (a few elements amid drift); None otherwise."""
    spikes = moves.spikes(index, thresholds)
    if spikes and moves.ulps(index) < thresholds.floor_ulps:
        peak, ratio = max(spikes)
        return peak / float(moves.epsilons[index].max()), ratio
    return None


def shape_dependence(reference: RunRecord, run: RunRecord, culprit: FirstMoved,
                     traced: Traced | None = None) -> str | None:
    """Where ``culprit`` is a compute op: "depends on the shape: ..." when the same op introduced a difference at
    some input shapes and, at others, ran on inputs that had not moved and kept within drift (cuBLAS, hipBLASLt
    and oneDNN pick kernels by shape, so such a bug is the kernel's of those shapes). None otherwise, and where
    the records cannot be analysed."""
    if culprit.site != "compute" or culprit.entry is None:
        return None
    traced = traced or Traced.of(reference, run)
    if traced is None:
        return None
    wrong, right = _shapes_both_ways(traced, culprit.rank, culprit.entry)
    if not wrong or not right or set(wrong) & set(right):  # one shape both ways: the shape does not decide it
        return None
    return f"depends on the shape: {culprit.entry.op} introduced a difference at {_listed(wrong)}, and none at " \
           f"{_listed(right)}, whose inputs had not moved (rank {culprit.rank}, step-0 op trace)"


def _shapes_both_ways(traced: Traced, rank: int, culprit: TraceOp) -> tuple[Counter[str], Counter[str]]:
    """Per input shapes, how often ``culprit``'s op, in its pass, introduced a difference on ``rank``, and how often
    it ran on inputs that had not moved and kept within drift (where a bug at that shape would have shown)."""
    thresholds, trace, moves, others = traced.thresholds, traced.run[rank], traced.moves[rank], traced.others(rank)
    wrong: Counter[str] = Counter()
    right: Counter[str] = Counter()
    for index in filter(moves.paired, range(len(moves))):
        entry = trace.entry(index)
        # The same op in the same pass: a backward-only bug must not read as one of the forward's shapes.
        if (entry.op, entry.phase) != (culprit.op, culprit.phase):
            continue
        inputs = _inputs_moved(index, trace, moves, others)
        if _introduces(index, inputs, moves, thresholds) is not None:
            wrong[entry.inputs] += 1
        elif moves.ulps(index) < thresholds.floor_ulps and all(
                explained(inputs, size) < thresholds.floor_ulps * eps
                for size, eps in zip(moves.sizes[index], moves.epsilons[index])):
            right[entry.inputs] += 1
    return wrong, right


def _listed(shapes: Counter[str]) -> str:
    return "; ".join(f"{shape} ({n} op{'s' if n != 1 else ''})" for shape, n in shapes.items())
