"""Every collective of a training run checked by its own invariants, across its ranks, at every step. numpy only.

A replay starts a fresh process, where a bug needing a warmed-up one (a reused buffer pool, a counter) does not
recur; so the ranks' per-call ledger rows (training/collective_ledger.py) are set side by side after training:
equal output bits, sums kept exactly or within rounding, and position-weighted sums that catch swapped elements.
The invariants and the rounding bound: docs/triage.md, "Collectives by their own invariants"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..findings import CheckFinding

RESULT_KEY = "collective_invariants"
LAMBDA = 8.0  # deviations of the rounding errors' sum: thousands of checks a run, none a false alarm
# Columns of a rank's ledger rows (training/collective_ledger.py writes them in this order).
COLUMNS = ("step", "group", "seq", "op", "reduce", "factor", "unit_roundoff", "size", "in_sum", "in_abs", "in_sq",
           "out_sum", "out_abs", "out_sq", "out_hash", "in_wsum", "out_wsum")
_COL = {name: i for i, name in enumerate(COLUMNS)}
SAME_BITS = ("all_gather", "broadcast", "all_reduce")
KEEPS_SUM = ("all_gather", "all_to_all")  # a permutation or a concatenation of the inputs: the same total
REDUCES = ("all_reduce", "reduce_scatter")
MAX_SHOWN = 8


@dataclass(frozen=True)
class Violation:
    step: int
    op: str
    group: str
    seq: int
    ranks: tuple[int, ...]  # the ranks whose output is not what the invariant asks
    what: str

    def describe(self) -> str:
        who = f"rank{'s' if len(self.ranks) != 1 else ''} {', '.join(map(str, self.ranks))}" if self.ranks else \
            "the group"
        return f"step {self.step}: {self.op} call {self.seq} of process group [{self.group}]: {self.what} ({who})"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "op": self.op, "group": self.group, "seq": self.seq, "ranks": list(self.ranks),
                "what": self.what}


def check(rows: Mapping[int, np.ndarray], ops: list[str], groups: list[str], reductions: list[str]) -> tuple[int, list[Violation]]:
    """(calls checked, violations), from each global rank's ledger rows; ``ops``, ``groups`` and ``reductions`` are
    the string tables the rows index. Calls are paired across ranks by (group, seq): the n-th call on one group."""
    by_call: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    for rank, table in rows.items():
        for row in np.asarray(table, dtype=np.float64).reshape(-1, len(COLUMNS)):
            by_call.setdefault((int(row[_COL["group"]]), int(row[_COL["seq"]])), {})[rank] = row
    violations: list[Violation] = []
    for (group, seq), members in sorted(by_call.items(), key=lambda kv: (min(int(r[0]) for r in kv[1].values()), kv[0])):
        found = _judge(members, ops, reductions)
        if found is not None:
            what, ranks = found
            first = next(iter(members.values()))
            violations.append(Violation(int(first[_COL["step"]]), ops[int(first[_COL["op"]])], groups[group], seq,
                                        ranks, what))
    return len(by_call), violations


def _judge(members: dict[int, np.ndarray], ops: list[str], reductions: list[str]) -> tuple[str, tuple[int, ...]] | None:
    """What breaks in one call, seen from its ranks' rows; None where its invariants hold."""
    ranks = sorted(members)
    if len(ranks) < 2:
        return None
    rows = np.stack([members[r] for r in ranks])
    op = ops[int(rows[0, _COL["op"]])]
    if len({ops[int(r)] for r in rows[:, _COL["op"]]}) > 1:
        return "the ranks called different collectives at this place", tuple(ranks)
    for invariant in (_same_bits, _sums_hold, _in_place):
        broken = invariant(rows, ranks, op, reductions)
        if broken is not None:
            return broken
    return None


def _same_bits(rows: np.ndarray, ranks: list[int], op: str, reductions: list[str]) -> tuple[str, tuple[int, ...]] | None:
    """Every rank's output has the same bits (all_gather, broadcast, all_reduce)."""
    hashes = np.ascontiguousarray(rows[:, _COL["out_hash"]]).view(np.int64)
    inputs, outputs = rows[:, _COL["in_sum"]].sum(), rows[:, _COL["out_sum"]]
    if op in SAME_BITS and len(set(hashes.tolist())) > 1:
        # Which rank holds the wrong values: the one whose output does not sum to what the inputs give (an
        # all-gather's every input, an all-reduce's reduction), else the one outvoted by the others' bits.
        odd = _odd_ones(hashes.tolist(), ranks)
        if op in ("all_gather", "all_reduce") and len(odd) > 1:
            expected = inputs if op == "all_gather" else _reduced(rows, reductions, len(ranks), inputs)
            if expected is not None:  # the ranks much further from it than the closest one
                misses = np.abs(outputs - expected)
                bar = 10 * float(misses.min()) + 1e-12 * float(rows[:, _COL["in_abs"]].sum())
                off = [r for r, miss in zip(ranks, misses) if miss > bar]
                odd = tuple(off) if 0 < len(off) < len(ranks) else odd
        return "the ranks' outputs have different bits, where every rank must hold the same values", odd
    return None


def _sums_hold(rows: np.ndarray, ranks: list[int], op: str, reductions: list[str]) -> tuple[str, tuple[int, ...]] | None:
    """The outputs' sums are the inputs' (a copy's exactly, a reduction's within rounding)."""
    inputs, outputs = rows[:, _COL["in_sum"]].sum(), rows[:, _COL["out_sum"]]
    scale = float(rows[:, _COL["in_abs"]].sum())
    if op in KEEPS_SUM:
        expected = inputs * (len(ranks) if op == "all_gather" else 1)  # every rank's output holds every input
        total = float(outputs.sum())
        allowed = 1e-12 * max(scale * len(ranks), 1e-300)
        if abs(total - expected) > allowed:
            worst = _worst_rank(rows, ranks, inputs if op == "all_gather" else None)
            return (f"its outputs sum to {total:.17g} where its inputs give {expected:.17g}: values were lost, "
                    f"repeated or changed in transit", worst)
        return None
    summed = _summed(rows, ranks, op, reductions)
    if summed is not None:
        reduction, factor, divisor = summed
        expected = inputs * factor / divisor
        total = _reduced_total(outputs, op)
        allowed = _rounding_bound(rows, ranks, reduction, factor, divisor) + 1e-12 * scale  # the float64 sums' own rounding
        if not abs(total - expected) <= allowed:
            worst = _worst_rank(rows, ranks, expected if op == "all_reduce" else None)
            return (f"its outputs sum to {total:.17g} where the {reduction.upper()} of its inputs gives "
                    f"{expected:.17g}, {abs(total - expected) / max(allowed, 1e-300):.3g}x the rounding bound "
                    f"{allowed:.3g}", worst)
    return None


def _summed(rows: np.ndarray, ranks: list[int], op: str, reductions: list[str]) -> tuple[str, float, int] | None:
    """A reduction's (name, factor, divisor) where it sums; None for another op, and for max, min and product:
    no sum invariant to hold them to. The factor is PREMUL_SUM's: each input times it, then summed."""
    if op not in REDUCES:
        return None
    reduction = reductions[int(rows[0, _COL["reduce"]])]
    if reduction not in ("sum", "avg", "premul_sum"):
        return None
    return reduction, float(rows[0, _COL["factor"]]), len(ranks) if reduction == "avg" else 1


def _reduced_total(outputs: np.ndarray, op: str) -> float:
    """What a reduction's outputs hold in total: a reduce-scatter's shards add up, an all-reduce's copies are one."""
    return float(outputs.sum()) if op == "reduce_scatter" else float(outputs.mean())


def _rounding_bound(rows: np.ndarray, ranks: list[int], reduction: str, factor: float, divisor: int) -> float:
    """How far a reduction's output total may be from its inputs' by rounding alone: LAMBDA x u x sqrt(rounds x N x
    the inputs' sum of x^2), independent per-element errors (comparison/bounds.py's model) with a tail of LAMBDA deviations."""
    rounds = len(ranks) - 1 + (1 if reduction != "sum" else 0)
    unit = float(rows[0, _COL["unit_roundoff"]])
    squares = float(rows[:, _COL["in_sq"]].sum())
    return LAMBDA * unit * math.sqrt(max(rounds, 1) * len(ranks) * squares) * abs(factor) / divisor


def _gathered_in_place(ranks: list[int], weighted_out: np.ndarray, expected: float,
                       scale: float) -> tuple[str, tuple[int, ...]] | None:
    """An all-gather's: each rank's output holds every input at its rank's place (float64 rounding only)."""
    allowed = 1e-12 * max(scale, 1e-300)
    off = tuple(r for r, got in zip(ranks, weighted_out) if abs(float(got) - expected) > allowed)
    if not off:
        return None
    return (f"its output holds its inputs' values but not each in its place (position-weighted sums "
            f"{', '.join(f'{float(g):.17g}' for g in weighted_out)} where the inputs give {expected:.17g})", off)


def _in_place(rows: np.ndarray, ranks: list[int], op: str, reductions: list[str]) -> tuple[str, tuple[int, ...]] | None:
    """The position-weighted sums: every element in its place. An all-gather's output on each rank holds every
    input at its rank's place (float64 rounding only); a reduction's weighted outputs total its weighted inputs
    within the rounding bound (weights at most 1.5)."""
    if op not in ("all_gather", *REDUCES):
        return None
    weighted_in, weighted_out = rows[:, _COL["in_wsum"]], rows[:, _COL["out_wsum"]]
    if not (np.isfinite(weighted_in).all() and np.isfinite(weighted_out).all()):
        return None  # rows of a ledger that kept no weighted sums
    expected = float(weighted_in.sum())
    scale = 1.5 * float(rows[:, _COL["in_abs"]].sum())
    if op == "all_gather":
        return _gathered_in_place(ranks, weighted_out, expected, scale)
    summed = _summed(rows, ranks, op, reductions)
    if summed is None:
        return None
    reduction, factor, divisor = summed
    expected = expected * factor / divisor
    total = _reduced_total(weighted_out, op)
    allowed = 1.5 * _rounding_bound(rows, ranks, reduction, factor, divisor) + 1e-12 * scale
    if abs(total - expected) <= allowed:
        return None
    return (f"its outputs hold the {reduction.upper()} of its inputs' values but not each in its place: their "
            f"position-weighted sum is {total:.17g} where the inputs' gives {expected:.17g}, "
            f"{abs(total - expected) / max(allowed, 1e-300):.3g}x the rounding bound", ())


def _reduced(rows: np.ndarray, reductions: list[str], world: int, inputs: float) -> float | None:
    """The sum a reduction's output should have, from its inputs' (None for a reduction with no such sum)."""
    reduction = reductions[int(rows[0, _COL["reduce"]])]
    if reduction not in ("sum", "avg", "premul_sum"):
        return None
    return inputs * float(rows[0, _COL["factor"]]) / (world if reduction == "avg" else 1)


def _odd_ones(hashes: list[int], ranks: list[int]) -> tuple[int, ...]:
    """The ranks whose hash is not the most common one (with two ranks that disagree: both)."""
    counts = {h: hashes.count(h) for h in hashes}
    common = max(counts.values())
    if list(counts.values()).count(common) > 1:
        return tuple(ranks)
    usual = max(counts, key=lambda h: counts[h])
    return tuple(r for r, h in zip(ranks, hashes) if h != usual)


def _worst_rank(rows: np.ndarray, ranks: list[int], expected_each: float | None) -> tuple[int, ...]:
    """Where every rank's output should sum to one value (an all-gather's, an all-reduce's): the rank furthest from
    it; otherwise (a reduce-scatter: each rank holds its own part) the group."""
    if expected_each is None:
        return ()
    misses = np.abs(rows[:, _COL["out_sum"]] - expected_each)
    return (ranks[int(np.argmax(misses))],)


def summary(calls: int, violations: list[Violation], ops: list[str] | None = None) -> dict[str, Any]:
    """What a record keeps: the count of calls checked, the collectives they were, and the first violations (each a
    few numbers)."""
    return {"calls": calls, "violated": len(violations), "violations": [v.to_json() for v in violations[:MAX_SHOWN]],
            "ops": list(ops or [])}


# The collectives that carry gradients (FSDP2's reduce-scatter; DDP's all-reduce reaches the ledger only where it is
# called from Python, and its C++ reducer's never does): only where the ledger checked one of them do its invariants
# speak for the gradients a late window finds wrong.
GRADIENT_COLLECTIVES = ("reduce_scatter",)


def held(record_results: Mapping[str, Any]) -> str | None:
    """Where every collective the run checked kept its invariants and the gradients' own collectives were among
    them: what was checked, in words; None otherwise (a violation, no ledger, or no gradient collective seen)."""
    kept = record_results.get(RESULT_KEY)
    if not isinstance(kept, dict) or kept.get("violated") or not kept.get("calls"):
        return None
    ops = [str(op) for op in kept.get("ops", [])]
    if not any(name in op for op in ops for name in GRADIENT_COLLECTIVES):
        return None
    return f"{kept['calls']} calls ({', '.join(ops)}) checked across the ranks at every step, every one kept its " \
           "invariants"


def problems(record_results: Mapping[str, Any]) -> list[CheckFinding]:
    """The finding of a run whose collectives broke an invariant; [] where none did or none ran."""
    kept = record_results.get(RESULT_KEY)
    if not isinstance(kept, dict) or not kept.get("violated"):
        return []
    shown = [Violation(v["step"], v["op"], v["group"], v["seq"], tuple(v["ranks"]), v["what"]).describe()
             for v in kept.get("violations", [])]
    more = int(kept["violated"]) - len(shown)
    first = f"a collective broke its own invariant in this run ({kept['violated']} of {kept['calls']} " \
            f"calls, checked across the ranks at every step, no replay needed): {shown[0]}"
    lines = [first, *(f"    also {line}" for line in shown[1:]), *([f"    and {more} more"] if more > 0 else [])]
    return [CheckFinding("collective-invariants", "\n".join(lines))]
