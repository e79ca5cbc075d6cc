"""The collective sweep's plan: cases, sizes, ids, inputs with exactly known results, verdicts. torch-free.

Inputs are small integers of rank and index, exact in bf16 and wider, so every output element has a
closed-form answer compared bit for bit (the nccl-tests method); the formulas use integer operators only, so
they run on numpy here and on torch in the ranks. Size ``n`` is elements per rank per peer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from ...units import human_bytes

# dtype name -> (element bytes, torch attribute); bf16r and fp16r: bf16 and fp16 SUM whose sums round (rounding_values)
DTYPES: dict[str, tuple[int, str]] = {
    "fp32": (4, "float32"), "bf16": (2, "bfloat16"), "fp16": (2, "float16"), "int32": (4, "int32"),
    "fp8e4m3": (1, "float8_e4m3fn"), "fp8e5m2": (1, "float8_e5m2"), "bf16r": (2, "bfloat16"), "fp16r": (2, "float16"),
}
# rounding dtype -> significant bits of its storage dtype (bf16: 8, fp16: 11)
ROUNDING = {"bf16r": 8, "fp16r": 11}
ROUNDING_SIZES = (8, 1031, 65536)  # small, a tail of 7, mid-size: its inputs are not about size bands
REDUCE_OPS = ("sum", "avg", "max", "min", "premul_sum")
# (op, variant, reduce op, in place)
KINDS: list[tuple[str, str, str, bool]] = [
    *[("all_reduce", "", r, True) for r in REDUCE_OPS],
    ("reduce_scatter", "single", "sum", False), ("reduce_scatter", "single", "sum", True),
    ("reduce_scatter", "single", "avg", False),
    ("reduce_scatter", "single", "premul_sum", False),  # FSDP2's gradient path with a divide factor
    ("reduce_scatter", "list", "sum", False),
    ("all_gather", "single", "", False), ("all_gather", "single", "", True), ("all_gather", "list", "", False),
    ("broadcast", "", "", True), ("all_to_all", "single", "", False), ("all_to_all", "list", "", False),
]
TAIL = 16  # elements at the end of a buffer that are also checked on their own
MOVE_ONLY = {"all_gather", "broadcast", "all_to_all"}


Op = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]
Variant = Literal["single", "list", ""]  # "": the op has one form
ReduceOp = Literal["sum", "avg", "max", "min", "premul_sum", ""]  # "": the op moves data only


@dataclass(frozen=True)
class Case:
    op: Op
    variant: Variant
    reduce_op: ReduceOp
    dtype: str
    n: int
    in_place: bool
    protocol: str = "default"

    @property
    def id(self) -> str:
        parts = [self.op, self.variant, self.reduce_op, self.dtype, f"n{self.n}",
                 "inplace" if self.in_place else "outofplace"]
        if self.protocol != "default":
            parts.insert(0, f"proto_{self.protocol}")
        return "-".join(p for p in parts if p)

    def nbytes(self, world: int) -> int:
        """Bytes of the larger buffer (nccl-tests' size column)."""
        elems = self.n if self.op in ("all_reduce", "broadcast") else world * self.n
        return elems * DTYPES[self.dtype][0]

    def bus_factor(self, world: int) -> float:
        """algbw x factor = busbw, as nccl-tests defines it."""
        if world == 1:
            return 1.0
        if self.op == "all_reduce":
            return 2 * (world - 1) / world
        return 1.0 if self.op == "broadcast" else (world - 1) / world

    @property
    def op_label(self) -> str:
        """The op and its form: "all_to_all(list)", "broadcast"."""
        return f"{self.op}({self.variant})" if self.variant else self.op

    def describe(self, world: int) -> str:
        op = self.op_label
        red = f" {self.reduce_op.upper()}" if self.reduce_op else ""
        where = "in place" if self.in_place else "out of place"
        proto = f", protocol {self.protocol}" if self.protocol != "default" else ""
        return f"{op}{red} {self.dtype} n={self.n} ({human_bytes(self.nbytes(world))}) {where}{proto}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sizes(max_bytes: int, elem_bytes: int, world: int) -> list[int]:
    """Powers of two from 1 element up to ``max_bytes`` on the large side, plus 1024 + 1..15."""
    out: list[int] = []
    n = 1
    while n * elem_bytes * world <= max_bytes:
        out.append(n)
        n *= 2
    if 1024 * elem_bytes * world <= max_bytes:
        out.extend(1024 + t for t in range(1, 16))
    return sorted(set(out))


# Why ``supported`` plans an op for a backend: where it was measured to run (gloo's all_to_all came in torch 2.12).
PLANNED_ON = {"gloo": "gloo runs every planned op on torch 2.12 and later", "nccl": "NCCL and RCCL run it"}


def supported(backend: str, op: str, reduce_op: str, dtype: str, emulated: tuple[str, ...] = ()) -> bool:
    """What each backend can run, as measured (gloo on torch 2.13: no PREMUL_SUM, no fp8, no int AVG); an older
    backend's lacking op is skipped as not supported when called (rank.py). ``emulated``: a fault shim's ops."""
    is_int = dtype == "int32"
    if dtype in ROUNDING:  # only a sum adds exactly two terms per element (rounding_values)
        return reduce_op == "sum" and op in ("all_reduce", "reduce_scatter")
    if dtype.startswith("fp8"):
        return backend == "nccl" and op in MOVE_ONLY
    if reduce_op == "premul_sum":
        return not is_int and (backend == "nccl" or ("premul_sum" in emulated and op == "all_reduce"))
    return not (reduce_op == "avg" and is_int)


def plan(backend: str, world: int, max_bytes: int, protocols: list[str] | None = None,
         emulated: tuple[str, ...] = ()) -> list[Case]:
    chosen = ["fp32", "bf16", "fp16", "int32", *ROUNDING] + (["fp8e4m3", "fp8e5m2"] if backend == "nccl" else [])
    cases: list[Case] = []
    for protocol in protocols or ["default"]:
        for op, variant, reduce_op, in_place in KINDS:
            for dtype in (d for d in chosen if supported(backend, op, reduce_op, d, emulated)):
                cases += [Case(op, variant, reduce_op, dtype, n, in_place, protocol)
                          for n in _sizes_of(dtype, max_bytes, world)]
    return cases


def _sizes_of(dtype: str, max_bytes: int, world: int) -> list[int]:
    elem = DTYPES[dtype][0]
    if dtype in ROUNDING:  # a few sizes: the other cases of the dtype already cover every size band
        return [n for n in ROUNDING_SIZES if n * elem * world <= max_bytes]
    return sizes(max_bytes, elem, world)


LINK_SIZES = (1, 7, 1031, 4096)  # elements per rank per peer: one element, a short tail, odd, a page


def link_cases() -> list[Case]:
    """The per-link sweep: the ops whose every output element comes from one known rank, fp32, a few sizes."""
    return [Case(op, variant, reduce_op, "fp32", n, in_place)
            for op, variant, reduce_op, in_place in KINDS if op in MOVE_ONLY for n in LINK_SIZES]


# Largest integer that every code path keeps exact: bf16 (and so every wider type) to 256, e4m3 to
# 16, e5m2 to 8. fp8 cases only move data, so their values never add up.
_EXACT_INTEGERS = {"fp8e4m3": 16, "fp8e5m2": 8}


def value_limit(world: int, dtype: str) -> int:
    """Largest input value: sums over ``world`` ranks must stay exact."""
    if dtype in _EXACT_INTEGERS:
        return _EXACT_INTEGERS[dtype] - 1
    return max(2, 256 // max(world, 1) - 1)


def rank_values(idx: Any, rank: int, world: int, dtype: str, salt: int = 0) -> Any:
    """Input element ``idx`` of ``rank``: 1..K, depending on both (idx is an int64 array or tensor).
    ``salt`` (the repeat number) changes every value between repeats, so a stale buffer from the
    previous call is wrong, not accidentally right."""
    k = value_limit(world, dtype)
    return (idx * 7 + rank * 13 + salt * 5) % k + 1


def avg_values(idx: Any, rank: int, world: int, dtype: str, salt: int = 0, premultiplied: bool = False) -> Any:
    """Inputs whose sum over ranks is world x base, so AVG and PREMUL_SUM(1/world) are exact where the backend sums
    then divides (gloo) or 1/world is exact. ``premultiplied`` (NCCL, RCCL, with 1/world inexact): the rounded terms'
    sum depends on the algorithm's order, so each element gets two ranks holding 2^e, the rest 0: exact in any order.
    Two, not one, so a reduction that keeps one rank's value (MAX, a lost peer) fails."""
    k = value_limit(world, dtype)
    if premultiplied:
        exponent = (idx * 7 + salt * 5) % max(1, k.bit_length() - 1)  # 2 x 2^e stays within the exact range
        first = idx % world
        mine = (first == rank) | ((first + 1) % world == rank)
        return mine * (1 << exponent)
    base = (idx * 7 + salt * 5) % max(1, k - 2) + 2
    pairs = world - (world % 2)
    delta = 0 if rank >= pairs else (1 if rank % 2 == 0 else -1)
    return base + delta


def _rounding_pairs(bits: int) -> list[tuple[int, int]]:
    """The (a, b) of ``rounding_values`` in half units, around M = 2**bits, where the dtype's ulp is 2.

    Each comment: the exact a + b -> rounded to nearest even (RNE) -> what truncation (toward zero) gives."""
    m2 = 2 << bits  # 2M: M in half units
    return [
        (m2, 2),  # M + 1, a tie -> M (even; half-up gives M + 2)
        (m2 + 4, 2),  # M + 3, a tie -> M + 4 (even) -> truncation: M + 2
        (m2, 3),  # M + 1.5 -> M + 2 -> truncation: M
        (m2 + 4, -1),  # M + 1.5 from opposite signs -> M + 2 -> truncation: M
        (-(m2 + 4), -2),  # -(M + 3), a tie -> -(M + 4) -> truncation: -(M + 2)
        (-m2, -3),  # -(M + 1.5) -> -(M + 2) -> truncation: -M
        (2 * m2 - 4, 10),  # 2M + 3, over the binade (ulp 4) -> 2M + 4 -> truncation: 2M
        (m2 + 12, 1),  # M + 6.5, below half an ulp -> M + 6 (rounding up gives M + 8)
    ]


ROUNDING_EXPONENTS = 8  # pairs are scaled by 2**-4 .. 2**3: other exponents; fp16's largest sum is 32792
ROUNDING_UNIT = 2.0**-5  # rounding_values are integers in this unit: half units scaled by down to 2**-4


def unit(dtype: str) -> float:
    """What one integer of ``rounding_values`` is worth (1 for every other dtype): a power of two, so exact."""
    return ROUNDING_UNIT if dtype in ROUNDING else 1.0


def rounding_values(idx: Any, rank: int, world: int, dtype: str, salt: int = 0) -> Any:
    """Inputs (integers in ``unit(dtype)``) whose sum over ranks must round: exactly two nonzero terms per element,
    so any order rounds once, to RNE(a + b). The pairs (``_rounding_pairs``) cover ties to even both ways, which
    truncation and round-half-up each miss, signs and a binade crossing; no sum is 0, and every rank holds a term
    of 2/world of the elements, so a lost contribution shows."""
    pairs = _rounding_pairs(ROUNDING[dtype])
    first = idx % world
    second = (first + 1 + (idx // world) % max(1, world - 1)) % world  # never ``first`` when world > 1
    role = (first == rank) * 1 + (second == rank) * 2  # 0: holds nothing, 1: holds a, 2: holds b (3: one rank)
    table = [0] * len(pairs) + [a for a, _ in pairs] + [b for _, b in pairs] + [a + b for a, b in pairs]
    # 8 pairs and 8 exponents: masks and shifts, cheaper than % and // on large index tensors
    scale = 1 << (((idx >> 3) + salt) & (ROUNDING_EXPONENTS - 1))  # x 2**-4 .. 2**3, times 2**4 in unit
    return _lookup(table, role * len(pairs) + ((idx + salt) & (len(pairs) - 1))) * scale


def _lookup(table: list[int], index: Any) -> Any:
    """table[index] elementwise, for an int64 numpy array or torch tensor (on its device)."""
    if hasattr(index, "new_tensor"):
        return index.new_tensor(table)[index]
    import numpy as np

    return np.asarray(table, dtype=np.int64)[index]


def premultiplies_average(backend: str, dtype: str, world: int) -> bool:
    """True where the backend computes a float AVG as PREMUL_SUM by 1/world rounded to the dtype and that
    rounding shows: NCCL and RCCL (torch names both "nccl"; NCCL's hostToDevRedOp), at a world size that is not a
    power of two. gloo sums, then divides."""
    return "nccl" in backend and dtype in ("fp32", "bf16", "fp16") and world & (world - 1) != 0


def premul_factor(world: int) -> float:
    """1/world when that is a power of two (FSDP2's divide factor, the path of pytorch#190745), else 0.5."""
    return 1.0 / world if world & (world - 1) == 0 else 0.5


def expected_reduction(idx: Any, world: int, dtype: str, reduce_op: str, reduce: Any, salt: int = 0) -> Any:
    """Closed-form result of reducing element ``idx`` over all ranks. ``reduce(op, a, b)`` combines
    two arrays elementwise for max and min (numpy.maximum or torch.maximum, ...).
    For a rounding dtype: the exact sum, in ``unit(dtype)``; the caller rounds it once to the dtype."""
    if dtype in ROUNDING:
        return sum(rounding_values(idx, r, world, dtype, salt) for r in range(world))
    if reduce_op in ("avg", "premul_sum"):
        total = sum(avg_values(idx, r, world, dtype, salt) for r in range(world))
        return total / world if reduce_op == "avg" else total * premul_factor(world)
    result = rank_values(idx, 0, world, dtype, salt)
    for r in range(1, world):
        other = rank_values(idx, r, world, dtype, salt)
        result = result + other if reduce_op == "sum" else reduce(reduce_op, result, other)
    return result


def inputs_for(case: Case, idx: Any, rank: int, world: int, salt: int = 0, backend: str = "gloo") -> Any:
    if case.dtype in ROUNDING:
        return rounding_values(idx, rank, world, case.dtype, salt)
    if case.reduce_op in ("avg", "premul_sum"):
        premultiplied = case.reduce_op == "avg" and premultiplies_average(backend, case.dtype, world)
        return avg_values(idx, rank, world, case.dtype, salt, premultiplied)
    return rank_values(idx, rank, world, case.dtype, salt)


def merge_rank_results(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Sum wrong-element counts over ranks (the nccl-tests #wrong column); keep the first wrong rank."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, results in enumerate(per_rank):
        for case_id, res in results.items():
            into = merged.setdefault(case_id, {"wrong": 0, "tail_wrong": 0, "bad_repeats": 0, "repeats": 0,
                                               "first": None, "error": None, "time_s": 0.0, "nbytes": res["nbytes"],
                                               "case": res["case"]})
            _merge_rank(into, res, rank)
    return merged


def _merge_rank(into: dict[str, Any], res: dict[str, Any], rank: int) -> None:
    for key in ("wrong", "tail_wrong"):
        into[key] += res[key]
    for key in ("bad_repeats", "repeats", "time_s"):  # the slowest rank sets the pace
        into[key] = max(into[key], res[key])
    for pair, count in res.get("links", {}).items():  # sender -> receiver: wrong elements (rank.py)
        into.setdefault("links", {})[pair] = into.get("links", {}).get(pair, 0) + count
    if res.get("first") and into["first"] is None:
        into["first"] = {**res["first"], "rank": rank}
    for said in ("error", "unsupported", "cast_error"):
        if res.get(said) and into.get(said) is None:
            into[said] = f"rank {rank}: {res[said]}"


def lacks_only(result: dict[str, Any]) -> bool:
    """The backend lacks the case's op on some rank, and no rank raised otherwise or saw a wrong element: nothing was
    computed wrong, so the case is not supported rather than failed. Wrong numbers or an error anywhere outrank it."""
    return bool(result.get("unsupported")) and not result.get("error") and not result.get("wrong")


def problem(case: Case, result: dict[str, Any], world: int) -> str | None:
    """None when the case is right, or when the backend lacks its op (``unsupported``: nothing computed, nothing
    wrong); otherwise the failure message naming what a user needs."""
    what = case.describe(world)
    if result.get("error"):
        return f"{what}: raised {result['error']}"
    if not result["wrong"]:  # also where only ``lacks_only``: it has neither an error nor a wrong element
        return None
    first = result["first"] or {}
    intermittent = (f"on {result['bad_repeats']} of {result['repeats']} repeats (intermittent)"
                    if result["bad_repeats"] < result["repeats"] else f"on all {result['repeats']} repeats")
    links = "; wrong elements by link (sender -> receiver): " + ", ".join(
        f"{pair.replace('->', ' -> ')}: {count}" for pair, count in sorted(result["links"].items())
    ) if result.get("links") else ""
    return (
        f"{what}: {result['wrong']} wrong elements summed over ranks and repeats "
        f"({result['tail_wrong']} of them in the last {TAIL}), {intermittent}; "
        f"first wrong index {first.get('index')} on rank {first.get('rank')}: "
        f"expected {first.get('expected')!r}, got {first.get('got')!r}{links}"
    )


def bandwidth_table(cases: list[Case], results: dict[str, dict[str, Any]], world: int,
                    dtype: str | None = None, protocol: str = "default", op: str | None = None,
                    reduce_op: str | None = None) -> list[str]:
    """nccl-tests style rows: size, count, type, redop, time, algbw, busbw, #wrong. Figures, not verdicts.

    ``dtype``, ``op`` and ``reduce_op`` narrow the rows; the header is always the first line."""
    lines = [f"  {'op':<28} {'size':>10} {'count':>10} {'type':>8} {'redop':>10} {'time(us)':>10} "
             f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}"]
    wanted = {"protocol": protocol, "dtype": dtype, "op": op, "reduce_op": reduce_op}
    for case in cases:
        res = results.get(case.id)
        # only a case that ran its collective to the end on every rank has a time that means something
        timed = res is not None and not res.get("error") and not lacks_only(res)
        if timed and all(not want or getattr(case, key) == want for key, want in wanted.items()):
            lines.append(_bandwidth_row(case, res, world))
    return lines


def _bandwidth_row(case: Case, res: dict[str, Any], world: int) -> str:
    seconds = max(float(res["time_s"]), 1e-9)
    algbw = case.nbytes(world) / seconds / 1e9
    name = f"{case.op_label}{' inplace' if case.in_place else ''}"
    return (f"  {name:<28} {case.nbytes(world):>10} {case.n:>10} {case.dtype:>8} "
            f"{case.reduce_op or '-':>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} "
            f"{algbw * case.bus_factor(world):>11.3f} {res['wrong']:>7}")
