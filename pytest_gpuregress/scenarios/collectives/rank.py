"""The collective sweep on one rank: every planned case run and checked bit for bit.

Each collective runs with ``async_op=True`` then ``wait()``, so the call that caused an error raises it. Ranks
count their own wrong elements and the launcher sums the records: no collective reports on collectives. The inputs'
casts from float64 are checked against ml_dtypes first, so a wrong cast is named a kernel, not the collective.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ...errors import NotSupported
from ...reference.record import RunRecord
from ..base import RankContext
from . import plan

_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32"}


def _reduce_op(dist: Any, name: str, world: int) -> Any:
    if name == "premul_sum":
        return dist._make_nccl_premul_sum(plan.premul_factor(world))
    return getattr(dist.ReduceOp, name.upper())  # SUM, AVG, MAX, MIN


class CastMismatch(Exception):
    """A cast the sweep made its inputs or expected values with gave other bits than the format's definition."""


def _cast(values: Any, dtype: Any, torch: Any, unit: float = 1.0) -> Any:
    """int64 or float64 integers (worth ``unit`` each, a power of two) to ``dtype``, through float64 for floats
    (int64 -> fp8 has no kernel), checked against ml_dtypes' cast of the same float64 values (``CastMismatch``).

    The float cast rounds to nearest even, once where the value is exact in float32 (torch goes double -> float ->
    dtype): that is how a rounding case's exact sum becomes its expected value, independent of any collective."""
    if not dtype.is_floating_point:
        return values.to(dtype)
    wide = values.to(torch.float64) * unit
    cast = wide.to(dtype)
    _check_cast(wide, cast, torch)
    return cast


def _check_cast(wide: Any, cast: Any, torch: Any) -> None:
    """Raise CastMismatch where ``cast`` (``wide`` float64 values cast by the stack) is not what the format's
    round-to-nearest-even gives (ml_dtypes; numpy for float32 and float16)."""
    import ml_dtypes
    import numpy as np

    name = str(cast.dtype).removeprefix("torch.")
    target = {"float32": np.float32, "float16": np.float16}.get(name) or getattr(ml_dtypes, name, None)
    if target is None:
        return
    exact = wide.detach().cpu().numpy().astype(np.float32).astype(target)  # torch's own path: double -> float -> T
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(target).itemsize]
    got = cast.detach().cpu().contiguous().view(getattr(torch, _INT_VIEW[cast.element_size()])).numpy().view(width)
    differ = np.nonzero(got != exact.view(width))[0]
    if len(differ):
        i = int(differ[0])
        raise CastMismatch(f"the cast float64 -> {name} that made the case's inputs or expected values (aten "
                           f"_to_copy) gave other bits than {name}'s round to nearest even in {len(differ)} of "
                           f"{got.size} elements, first {float(wide.reshape(-1)[i])!r}: {float(cast.reshape(-1)[i].float())!r} "
                           f"where {float(exact.reshape(-1)[i].astype(np.float64))!r}: a conversion kernel; the collective "
                           "was never given what the case meant to send")


def _expected_reduction(case: plan.Case, idx: Any, backend: str, world: int, salt: int, dtype: Any, reduce: Any,
                        torch: Any) -> Any:
    """The reduced value of each element in ``dtype``, as the backend's documented algorithm computes it."""
    if case.reduce_op != "avg" or not plan.premultiplies_average(backend, case.dtype, world):
        exact = plan.expected_reduction(idx, world, case.dtype, case.reduce_op, reduce, salt)
        return _cast(exact, dtype, torch, plan.unit(case.dtype))
    # NCCL, as it documents the algorithm: each input times (T)(float)(1/world), then summed in T. The inputs
    # (plan.avg_values) make every term and every partial sum exact, so this order gives the one right answer.
    # NCCL's premultiplier: 1.0/world in double, rounded to float, then to the dtype.
    scalar = torch.tensor(1.0 / world, dtype=torch.float32).to(dtype).to(idx.device)
    total = None
    for rank in range(world):
        term = _cast(plan.inputs_for(case, idx, rank, world, salt, backend), dtype, torch) * scalar
        total = term if total is None else total + term
    return total


class _Buffers:
    """One repeat of one case on this rank: its inputs, blank outputs and expected values, built as the case's
    op needs them. Each op's method returns (call, output reader, expected)."""

    def __init__(self, case: plan.Case, ctx: RankContext, salt: int, torch: Any, made: dict[tuple, Any]) -> None:
        import torch.distributed as dist

        self.case, self.ctx, self.salt, self.torch, self.dist, self.made = case, ctx, salt, torch, dist, made
        self.dtype = getattr(torch, plan.DTYPES[case.dtype][1])
        self.w, self.r, self.n = ctx.world_size, ctx.rank, case.n

    def _made(self, key: tuple[Any, ...], make: Callable[[Any], Any]) -> Any:
        """``make(index)`` for the elements from ``key``'s offset on, made once per group of cases (``run``)."""
        key = (self.case.dtype, self.n, self.salt, *key)
        if key not in self.made:
            index = self.torch.arange(key[3], key[3] + self.n, dtype=self.torch.int64, device=self.ctx.device)
            self.made[key] = make(index)
        return self.made[key]

    def values(self, offset: int, rank: int) -> Any:
        """A fresh copy of ``rank``'s inputs from element ``offset``: collectives write into their inputs."""
        case = self.case  # inputs differ by reduce op only for avg and premul_sum (plan.inputs_for)
        return self._made((offset, rank, case.reduce_op if case.reduce_op in ("avg", "premul_sum") else ""), lambda idx: _cast(
            plan.inputs_for(case, idx, rank, self.w, self.salt, self.ctx.backend), self.dtype, self.torch,
            plan.unit(case.dtype))).clone()

    def chunks(self, rank: int) -> list[Any]:
        return [self.values(q * self.n, rank) for q in range(self.w)]

    def blank(self, count: int) -> Any:
        return self.torch.zeros(count, dtype=self.dtype, device=self.ctx.device)  # 0 is never an expected value

    def reduce(self, op: str, a: Any, b: Any) -> Any:
        return self.torch.maximum(a, b) if op == "max" else self.torch.minimum(a, b)

    def reduced(self, offset: int) -> Any:
        return self._made((offset, "reduced", self.case.reduce_op), lambda idx: _expected_reduction(
            self.case, idx, self.ctx.backend, self.w, self.salt, self.dtype, self.reduce, self.torch))

    def all_reduce(self) -> tuple[Any, Any, Any]:
        t = self.values(0, self.r)
        expected = self.reduced(0)
        return (lambda: self.dist.all_reduce(t, op=_reduce_op(self.dist, self.case.reduce_op, self.w), async_op=True)), \
            (lambda: t), expected

    def broadcast(self) -> tuple[Any, Any, Any]:
        root = self.w - 1  # not rank 0, so a root mix-up shows
        t = self.values(0, self.r)
        return (lambda: self.dist.broadcast(t, src=root, async_op=True)), (lambda: t), self.values(0, root)

    def all_gather(self) -> tuple[Any, Any, Any]:
        w, r, n, dist = self.w, self.r, self.n, self.dist
        expected = self.torch.cat([self.values(0, q) for q in range(w)])
        mine = self.values(0, r)
        if self.case.variant == "list":
            outs = [self.blank(n) for _ in range(w)]
            return (lambda: dist.all_gather(outs, mine, async_op=True)), (lambda: self.torch.cat(outs)), expected
        out = self.blank(w * n)
        if self.case.in_place:
            out[r * n : (r + 1) * n] = mine
            mine = out[r * n : (r + 1) * n]
        get_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: get_single(out, mine, async_op=True)), (lambda: out), expected

    def reduce_scatter(self) -> tuple[Any, Any, Any]:
        r, n, dist = self.r, self.n, self.dist
        op = _reduce_op(dist, self.case.reduce_op, self.w)
        expected = self.reduced(r * n)
        if self.case.variant == "list":
            out, ins = self.blank(n), self.chunks(r)
            return (lambda: dist.reduce_scatter(out, ins, op=op, async_op=True)), (lambda: out), expected
        full = self.torch.cat(self.chunks(r))
        out = full[r * n : (r + 1) * n] if self.case.in_place else self.blank(n)
        scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter_single(out, full, op=op, async_op=True)), (lambda: out), expected

    def all_to_all(self) -> tuple[Any, Any, Any]:
        w, r, n, dist = self.w, self.r, self.n, self.dist
        expected = self.torch.cat([self.values(r * n, s) for s in range(w)])
        if self.case.variant == "list":
            outs, ins = [self.blank(n) for _ in range(w)], self.chunks(r)
            return (lambda: dist.all_to_all(outs, ins, async_op=True)), (lambda: self.torch.cat(outs)), expected
        out, full = self.blank(w * n), self.torch.cat(self.chunks(r))
        return (lambda: dist.all_to_all_single(out, full, async_op=True)), (lambda: out), expected


def _wrong_by_sender(case: plan.Case, wrong: Any, world: int) -> dict[int, int]:
    """Wrong elements by the rank that sent them, where each output element has one sender (shared/links.py):
    chunk q of an all-gather or all-to-all output came from rank q, a broadcast from its root. {} for reductions."""
    if case.op not in plan.MOVE_ONLY:
        return {}
    if case.op == "broadcast":
        return {world - 1: int(wrong.sum())}
    per_sender = wrong.reshape(world, case.n).sum(dim=1).tolist()
    return {sender: int(count) for sender, count in enumerate(per_sender) if count}


def _timed(call: Any, ctx: RankContext, torch: Any) -> float:
    """Seconds ``call`` and the wait on its work took, the device synchronized either side."""
    if ctx.device_kind == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    work = call()
    if work is not None:
        work.wait()
    if ctx.device_kind == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _tally(result: dict[str, Any], case: plan.Case, ctx: RankContext, got: Any, expected: Any, salt: int,
           torch: Any) -> None:
    """Add one repeat's wrong elements (bit for bit) to ``result``: the count, by link, in the tail, the first."""
    view = getattr(torch, _INT_VIEW[got.element_size()])
    wrong = got.reshape(-1).view(view) != expected.reshape(-1).view(view)
    count = int(wrong.sum())
    if not count:
        return
    result["wrong"] += count
    for sender, wrong_from in _wrong_by_sender(case, wrong, ctx.world_size).items():
        pair = f"{sender}->{ctx.rank}"
        result["links"][pair] = result["links"].get(pair, 0) + wrong_from
    result["tail_wrong"] += int(wrong[-plan.TAIL :].sum())
    result["bad_repeats"] += 1
    if result["first"] is None:
        i = int(wrong.nonzero()[0])
        result["first"] = {"index": i, "expected": float(expected.reshape(-1)[i].float()),
                           "got": float(got.reshape(-1)[i].float()), "repeat": salt}


def _run_case(case: plan.Case, ctx: RankContext, repeats: int, torch: Any, made: dict[tuple, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"case": case.to_json(), "nbytes": case.nbytes(ctx.world_size), "wrong": 0,
                              "tail_wrong": 0, "bad_repeats": 0, "repeats": repeats, "first": None,
                              "error": None, "unsupported": None, "time_s": 0.0, "links": {}}
    times: list[float] = []
    for salt in range(repeats):
        try:
            call, read, expected = getattr(_Buffers(case, ctx, salt, torch, made), case.op)()
            times.append(_timed(call, ctx, torch))
            got = read()
        except CastMismatch as exc:  # what the case meant to send was never made: no collective to judge
            result["cast_error"] = str(exc)
            break
        except Exception as exc:  # noqa: BLE001 - a collective that raises is a finding, not a crash
            # A backend that lacks the op (gloo's all_to_all before torch 2.12) computed nothing wrong: kept apart.
            said = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            result["unsupported" if NotSupported.backend_lacks(exc) else "error"] = said
            break
        _tally(result, case, ctx, got, expected, salt, torch)
    result["time_s"] = statistics.median(times) if times else 0.0
    return result


def run(ctx: RankContext) -> RunRecord:
    """Run every case of ``ctx.config["cases"]``; count this rank's wrong elements per case."""
    import torch

    repeats = int(ctx.config.get("repeats", 3))
    results: dict[str, Any] = {}
    # "link_sweep": the consensus scenario's small per-link sweep (plan.link_cases), planned here as in the session
    cases = plan.link_cases() if ctx.config.get("link_sweep") else [plan.Case(**c) for c in ctx.config["cases"]]
    # Cases grouped by dtype and size: the ops of a group share its inputs and expected values, made once and
    # cast-checked once (making them costs more than the collectives). Results are keyed by case, as before.
    made: dict[tuple, Any] = {}
    for number, case in enumerate(sorted(cases, key=lambda c: (c.dtype, c.n))):
        if made and next(iter(made))[:2] != (case.dtype, case.n):
            made.clear()
        results[case.id] = _run_case(case, ctx, repeats, torch, made)
        if number % 50 == 0:
            ctx.progress(f"case {number} of {len(cases)}: {case.id}")
    # Who this rank is (host, node, device, its GPU links), so a wrong link can be named (scenarios/shared/links.py).
    from ...stack import device_identity as identity

    who = identity.probe(ctx.rank, ctx.local_rank, ctx.device_kind, torch)
    who["links"] = identity.peer_links(who)
    return RunRecord(scenario="collectives", config={k: v for k, v in ctx.config.items() if k != "cases"},
                     platform_key="", world_size=ctx.world_size, results={"cases": results, "identity": who})
