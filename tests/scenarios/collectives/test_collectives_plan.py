"""The sweep plan: exact inputs and results, sizes, ids, capabilities, merging and verdicts."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.errors import NotSupported
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import Case, Setup, registry
from pytest_gpuregress.scenarios.collectives import plan, protocol_groups
from pytest_gpuregress.triage.naming import described
from pytest_gpuregress.units import parse_bytes


def _np_reduce(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(a, b) if op == "max" else np.minimum(a, b)


def _exact_in(dtype: str, values: np.ndarray) -> bool:
    limit = {"bf16": 256, "fp16": 2048, "fp32": 1 << 24, "int32": 1 << 31, "fp8e4m3": 16, "fp8e5m2": 8}[dtype]
    return bool((np.abs(values) <= limit).all() and (values == np.round(values)).all())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "int32", "fp8e4m3", "fp8e5m2"])
def test_values_and_sums_stay_exact(world: int, dtype: str) -> None:
    idx = np.arange(4096, dtype=np.int64)
    for salt in range(3):
        ranks = [plan.rank_values(idx, r, world, dtype, salt) for r in range(world)]
        assert all(_exact_in(dtype, v) and v.min() >= 1 for v in ranks)
        if dtype.startswith("fp8"):
            continue  # fp8 only moves data
        partial = np.zeros_like(idx)
        for v in ranks:
            partial = partial + v
            assert _exact_in(dtype, partial)  # every partial sum of a ring or tree is exact
        np.testing.assert_array_equal(plan.expected_reduction(idx, world, dtype, "sum", _np_reduce, salt), partial)
        avg_inputs = [plan.avg_values(idx, r, world, dtype, salt) for r in range(world)]
        assert all(_exact_in(dtype, v) and v.min() >= 1 for v in avg_inputs)
        if world > 1:  # NCCL's premultiplied average: two equal powers of two per element, on ranks i and i + 1
            ncclish = [plan.avg_values(idx, r, world, dtype, salt, premultiplied=True) for r in range(world)]
            assert all(_exact_in(dtype, v) and _exact_in(dtype, 2 * v) for v in ncclish)
            np.testing.assert_array_equal(sum(v > 0 for v in ncclish), np.full_like(idx, min(world, 2)))
            assert all((v[r::world] > 0).all() and (v[(r - 1) % world::world] > 0).all() for r, v in enumerate(ncclish))
        avg = plan.expected_reduction(idx, world, dtype, "avg", _np_reduce, salt)
        assert _exact_in(dtype, avg) and avg.min() >= 1
        np.testing.assert_array_equal(avg * world, sum(avg_inputs))


def _nccl_average(inputs: list[np.ndarray], world: int, dtype: str, order: list[int]) -> Any:
    """NCCL's float AVG (hostToDevRedOp, then PreMulSum): each input times (T)(float)(1.0/world) in T, then summed
    in T in ``order``: one of the orders a ring or tree may add the ranks' terms."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    scalar = torch.tensor(float(np.float32(1.0 / world)), dtype=torch.float32).to(torch_dtype)
    terms = [torch.from_numpy(v.astype(np.float64)).to(torch_dtype) * scalar for v in inputs]
    total = terms[order[0]]
    for r in order[1:]:
        total = total + terms[r]
    return total


@pytest.mark.parametrize("world", [3, 5, 6, 7, 12])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_nccl_average_at_a_world_size_not_a_power_of_two_is_exactly_the_expected_value(world: int, dtype: str) -> None:
    import torch

    from pytest_gpuregress.scenarios.collectives.rank import _cast, _expected_reduction

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    case = plan.Case("all_reduce", "", "avg", dtype, 1024, True)
    idx = torch.arange(case.n, dtype=torch.int64)
    inputs = [plan.inputs_for(case, idx.numpy(), r, world, salt=1, backend="nccl") for r in range(world)]
    expected = _expected_reduction(case, idx, "nccl", world, 1, torch_dtype, None, torch)
    for order in (list(range(world)), list(reversed(range(world))), [*range(1, world), 0], [2, 0, *range(3, world), 1]):
        got = _nccl_average(inputs, world, dtype, order)
        assert torch.equal(got, expected), f"order {order}: {int((got != expected).sum())} elements differ"
    # A reduction that keeps one rank's value (MAX, or a peer's contribution lost) is wrong on every element.
    kept_one = torch.from_numpy(np.maximum.reduce(inputs).astype(np.float64)).to(torch_dtype)
    assert not torch.eq(kept_one * torch.tensor(float(np.float32(1 / world))).to(torch_dtype), expected).any()
    assert not torch.eq(kept_one, expected).any()
    # gloo sums, then divides: the closed form itself.
    assert torch.equal(_expected_reduction(case, idx, "gloo", world, 1, torch_dtype, None, torch),
                       _cast(plan.expected_reduction(idx, world, dtype, "avg", None, 1), torch_dtype, torch))


def test_the_old_paired_average_inputs_would_have_failed_nccl_at_six_ranks() -> None:
    # What the check guards against: every rank holding base +- 1, premultiplied by NCCL's rounded 1/6, gives a
    # result one ulp off the closed form for some elements in fp16: a false [collective] on a healthy NCCL.
    import torch

    world, idx = 6, np.arange(1024, dtype=np.int64)
    base = (idx * 7) % (plan.value_limit(world, "fp16") - 2) + 2
    paired = [base + (1 if r % 2 == 0 else -1) for r in range(world)]
    got = _nccl_average(paired, world, "fp16", list(range(world)))
    assert (got != torch.from_numpy(base.astype(np.float64)).to(torch.float16)).any()


def test_values_depend_on_rank_index_and_repeat() -> None:
    idx = np.arange(64, dtype=np.int64)
    a = plan.rank_values(idx, 0, 2, "bf16")
    assert not np.array_equal(a, plan.rank_values(idx, 1, 2, "bf16"))
    assert not np.array_equal(a, plan.rank_values(idx, 0, 2, "bf16", salt=1))
    assert len(set(a.tolist())) > 8


def test_premul_factor_is_the_power_of_two_path() -> None:
    assert plan.premul_factor(2) == 0.5 and plan.premul_factor(8) == 0.125 and plan.premul_factor(6) == 0.5


def test_sizes_cover_one_element_powers_of_two_and_every_tail() -> None:
    got = plan.sizes(64 << 10, 4, 2)
    assert got[0] == 1 and 8192 in got and 16384 not in got  # 16384 x 4 B x 2 ranks > 64 KiB
    assert {n % 16 for n in got if n > 1024} >= set(range(1, 16))


def test_capabilities_match_what_gloo_was_measured_to_run() -> None:
    assert not plan.supported("gloo", "all_reduce", "premul_sum", "fp32")
    assert plan.supported("gloo", "all_reduce", "premul_sum", "fp32", emulated=("premul_sum",))
    assert not plan.supported("gloo", "all_reduce", "avg", "int32")
    assert plan.supported("gloo", "all_reduce", "avg", "bf16")
    assert not plan.supported("gloo", "all_gather", "", "fp8e4m3")
    assert plan.supported("nccl", "all_gather", "", "fp8e4m3") and not plan.supported("nccl", "all_reduce", "sum", "fp8e4m3")


def test_plan_ids_are_unique_and_selectable() -> None:
    cases = plan.plan("nccl", 8, 1 << 20, protocols=["LL", "Simple"])
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    assert "proto_LL-all_reduce-avg-bf16-n1024-inplace" in ids
    assert "proto_Simple-all_gather-single-fp8e4m3-n1-outofplace" in ids
    assert "all_to_all-list-int32-n4-outofplace" in [c.id for c in plan.plan("gloo", 2, 1 << 20)]


def test_wrong_counts_are_summed_over_ranks() -> None:
    case = plan.Case("all_reduce", "", "avg", "bf16", 1024, True)
    clean = {"case": case.to_json(), "nbytes": 2048, "wrong": 0, "tail_wrong": 0, "bad_repeats": 0, "repeats": 3,
             "first": None, "error": None, "time_s": 1e-4}
    bad = {**clean, "wrong": 8, "tail_wrong": 8, "bad_repeats": 1,
           "first": {"index": 1016, "expected": 5.0, "got": 0.0, "repeat": 2}, "time_s": 2e-4}
    merged = plan.merge_rank_results([{case.id: clean}, {case.id: bad}])[case.id]
    assert merged["wrong"] == 8 and merged["first"]["rank"] == 1 and merged["time_s"] == 2e-4
    message = plan.problem(case, merged, 2)
    assert message is not None
    for part in ("all_reduce AVG bf16 n=1024 (2 KiB) in place", "8 wrong elements", "8 of them in the last 16",
                 "on 1 of 3 repeats (intermittent)", "first wrong index 1016 on rank 1", "expected 5.0, got 0.0"):
        assert part in message
    assert plan.problem(case, plan.merge_rank_results([{case.id: clean}])[case.id], 2) is None


@pytest.mark.parametrize(("error", "lacks"), [
    (RuntimeError("Backend gloo does not support alltoall"), "Backend gloo does not support alltoall"),  # gloo < 2.12
    ("rank 1: RuntimeError: Backend gloo does not support reduce_scatter_tensor_coalesced",
     "Backend gloo does not support reduce_scatter_tensor_coalesced"),
    # an op that ran and failed is an error, never a skip, whatever words it uses
    (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), None),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    (RuntimeError("NCCL error: unhandled cuda error, Last error: Cuda failure 801 'operation not supported'"), None),
    (RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'"), None),
    (NotImplementedError("alltoall"), None),
    (RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a single memory "
                  "location"), None),
    (RuntimeError("Backend nccl does not support setting timeout"), None),  # not a collective
])
def test_a_backend_that_lacks_an_op_is_told_from_an_op_that_failed(error: BaseException | str, lacks: str | None) -> None:
    assert NotSupported.backend_lacks(error) == lacks


def test_an_unsupported_case_is_neither_wrong_nor_an_error_and_is_counted_apart() -> None:
    case = plan.Case("all_to_all", "list", "", "fp32", 1, False)
    refused = "RuntimeError: Backend gloo does not support alltoall"
    lacking = {"case": case.to_json(), "nbytes": 8, "wrong": 0, "tail_wrong": 0, "bad_repeats": 0, "repeats": 3,
               "first": None, "error": None, "unsupported": refused, "time_s": 0.0}
    merged = plan.merge_rank_results([{case.id: lacking}, {case.id: lacking}])
    assert merged[case.id]["unsupported"] == f"rank 0: {refused}"  # the first rank's own error, named by its rank
    assert merged[case.id]["error"] is None and plan.problem(case, merged[case.id], 2) is None
    assert plan.bandwidth_table([case], merged, 2) == plan.bandwidth_table([], merged, 2)  # no row: nothing was timed
    record = RunRecord(scenario="collectives", config={}, platform_key="", world_size=2, results={"cases": merged},
                       fingerprint={"versions": {"torch": "2.8.0"}})
    sweep = registry()["collectives"]
    setup = Setup("cpu", "gloo", 2)
    said = sweep.unsupported(Case(case.id, data=case.to_json()), record, setup)
    lacks = re.match(r"(\w+) on torch (\S+) lacks (\S+) (\w+) n=(\d+) \((\d+) B\)", said or "")
    assert lacks is not None and lacks.groups() == ("gloo", "2.8.0", "all_to_all(list)", "fp32", "1", "8"), said
    assert sweep.own_findings(Case(case.id, data=case.to_json()), record, setup) == []
    # A rank that saw wrong elements, or raised otherwise, outranks another rank's missing op: judged, not skipped.
    wrong = plan.merge_rank_results([{case.id: lacking}, {case.id: {**lacking, "unsupported": None, "wrong": 2,
                                                                    "first": {"index": 0, "expected": 1.0, "got": 0.0}}}])
    assert plan.problem(case, wrong[case.id], 2) is not None and not plan.lacks_only(wrong[case.id])


def test_bus_bandwidth_factors_follow_nccl_tests() -> None:
    assert plan.Case("all_reduce", "", "sum", "fp32", 1, True).bus_factor(8) == 2 * 7 / 8
    assert plan.Case("all_gather", "single", "", "fp32", 1, False).bus_factor(8) == 7 / 8
    assert plan.Case("broadcast", "", "", "fp32", 1, True).bus_factor(8) == 1.0


def test_parse_bytes_and_protocol_groups() -> None:
    assert parse_bytes("4MiB") == 4 << 20 and parse_bytes("512K") == 512 << 10 and parse_bytes("100") == 100
    assert protocol_groups(["LL", "Simple"], [], "gloo") == {"default": {}}
    groups = protocol_groups(["LL", "LL128"], ["Ring"], "nccl")
    assert groups == {"LL+Ring": {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"},
                      "LL128+Ring": {"NCCL_PROTO": "LL128", "NCCL_ALGO": "Ring"}}


# --- sums that must round (bf16r, fp16r) -----------------------------------------------------------------------


def _round_significand(x: float, bits: int, how: str) -> float:
    """``x`` to ``bits`` significant bits, independent of torch and ml_dtypes: Python's round() is round half to even;
    trunc is toward zero; half_up rounds ties away from zero. Exact: scaling by powers of two loses nothing."""
    import math

    _, exp = math.frexp(x)
    scaled = x * 2.0 ** (bits - exp)
    whole = {"rne": round(scaled), "trunc": math.trunc(scaled),
             "half_up": math.copysign(math.floor(abs(scaled) + 0.5), scaled)}[how]
    return float(whole) * 2.0 ** (exp - bits)


def _rounding_inputs(world: int, dtype: str, salt: int, n: int = 4096) -> tuple[np.ndarray, list[np.ndarray]]:
    idx = np.arange(n, dtype=np.int64)
    return idx, [plan.rounding_values(idx, r, world, dtype, salt).astype(np.float64) * plan.unit(dtype)
                 for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", ["bf16r", "fp16r"])
def test_rounding_inputs_are_exact_and_their_sums_round_once_to_nearest_even(world: int, dtype: str) -> None:
    import torch

    from pytest_gpuregress.scenarios.collectives.rank import _cast

    torch_dtype = getattr(torch, plan.DTYPES[dtype][1])
    bits = plan.ROUNDING[dtype]
    for salt in range(3):
        idx, inputs = _rounding_inputs(world, dtype, salt)
        if world > 1:  # every input is exact in the dtype; exactly two nonzero terms per element; every rank has some
            for values in inputs:  # (one rank alone holds a + b: the sweep never runs there, its cases need a peer)
                assert np.array_equal(torch.from_numpy(values).to(torch_dtype).double().numpy(), values)
            np.testing.assert_array_equal(sum((v != 0).astype(int) for v in inputs), np.full(idx.shape, 2))
            assert all((v != 0).sum() >= len(idx) // world for v in inputs)
        exact = sum(inputs)
        assert (exact == exact.astype(np.float32)).all()  # torch's double -> float -> dtype cast rounds once
        expected = _cast(torch.from_numpy(plan.expected_reduction(idx, world, dtype, "sum", None, salt)), torch_dtype,
                         torch, plan.unit(dtype)).double().numpy()
        rne = np.array([_round_significand(x, bits, "rne") for x in exact])
        np.testing.assert_array_equal(expected, rne)
        assert (expected != 0).all()  # output buffers start at 0
        assert (expected != exact).mean() > 0.7  # most sums round
        trunc = np.array([_round_significand(x, bits, "trunc") for x in exact])
        half_up = np.array([_round_significand(x, bits, "half_up") for x in exact])
        assert (trunc != rne).mean() > 0.5 and (half_up != rne).any()  # both wrong roundings show


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", ["bf16r", "fp16r"])
def test_rounding_sums_are_the_same_in_any_order_a_backend_adds_them(world: int, dtype: str) -> None:
    # Each partial sum is rounded to the dtype, as gloo and NCCL do (float accumulate, round to nearest even): with
    # one nonzero term besides a, every order rounds a + b once.
    import torch

    torch_dtype = getattr(torch, plan.DTYPES[dtype][1])
    idx, inputs = _rounding_inputs(world, dtype, salt=2)
    terms = [torch.from_numpy(v).to(torch_dtype) for v in inputs]
    expected = torch.from_numpy(sum(inputs)).to(torch_dtype)
    for order in (list(range(world)), list(reversed(range(world))), [*range(1, world), 0]):
        total = terms[order[0]]
        for r in order[1:]:
            total = total + terms[r]
        assert torch.equal(total, expected), order
    pairs = [terms[0] + terms[1], terms[1] + terms[0]] if world == 2 else []
    assert all(torch.equal(p, expected) for p in pairs)


def test_rounding_pairs_hold_ties_both_ways_and_non_ties() -> None:
    bits = plan.ROUNDING["bf16r"]
    sums = [(a + b) / 2 for a, b in plan._rounding_pairs(bits)]  # half units -> values around M = 256
    rne = [_round_significand(x, bits, "rne") for x in sums]
    assert 257.0 in sums and rne[sums.index(257.0)] == 256.0  # a tie down to even: half-up gives 258
    assert 259.0 in sums and rne[sums.index(259.0)] == 260.0  # a tie up to even: truncation gives 258
    assert -259.0 in sums and rne[sums.index(-259.0)] == -260.0
    assert 515.0 in sums and rne[sums.index(515.0)] == 516.0  # over the binade, where the ulp is 4
    assert all(x != 0 for x in sums)


def test_rounding_cases_are_sums_of_two_reductions_at_a_few_sizes() -> None:
    for backend in ("gloo", "nccl"):
        cases = [c for c in plan.plan(backend, 2, 4 << 20) if c.dtype in plan.ROUNDING]
        assert {(c.op, c.reduce_op) for c in cases} == {("all_reduce", "sum"), ("reduce_scatter", "sum")}
        assert {c.n for c in cases} == set(plan.ROUNDING_SIZES) and len(cases) == 2 * 4 * len(plan.ROUNDING_SIZES)
    ids = [c.id for c in plan.plan("gloo", 2, 4 << 20)]
    assert "all_reduce-sum-bf16r-n1031-inplace" in ids and "reduce_scatter-list-sum-fp16r-n8-outofplace" in ids
    assert all(c.n * 2 * 2 <= 16 << 10 for c in plan.plan("gloo", 2, 16 << 10) if c.dtype in plan.ROUNDING)
    case = plan.Case("all_reduce", "", "sum", "bf16r", 8, True)
    assert case.describe(2) == "all_reduce SUM bf16r n=8 (16 B) in place" and case.nbytes(2) == 16


@pytest.mark.parametrize(("rccl", "arch", "env", "ran"), [
    (True, "gfx942", {"NCCL_PROTO": "LL128"}, "Simple, not LL128: RCCL on gfx942 runs LL128 only with "
                                              "RCCL_LL128_FORCE_ENABLE=1"),
    (True, "gfx942", {"NCCL_PROTO": "LL128", "RCCL_LL128_FORCE_ENABLE": "1"}, "LL128 as pinned by NCCL_PROTO"),
    (True, "gfx950", {"NCCL_PROTO": "LL128"}, "LL128 as pinned by NCCL_PROTO"),
    (True, "gfx942", {"NCCL_PROTO": "LL"}, "LL as pinned by NCCL_PROTO"),
    (False, "sm_90", {"NCCL_PROTO": "LL128"}, "LL128 as pinned by NCCL_PROTO"),
    (False, "sm_90", {}, "the library's own choice"),
])
def test_the_protocol_that_ran_is_said_where_it_is_not_the_one_asked_for(rccl: bool, arch: str, env: dict[str, str],
                                                                          ran: str) -> None:
    """RCCL on MI300 (gfx942) silently runs Simple for NCCL_PROTO=LL128 unless forced: the sweep must not call
    Simple's results LL128's."""
    from pytest_gpuregress.scenarios.collectives import protocol_ran

    from ...conftest import make_record

    record = make_record()
    record.fingerprint = {"device": {"kind": "cuda", "arch": arch}, "comm": {"backend": "nccl", "rccl": rccl, "env": env}}
    label = env.get("NCCL_PROTO", "default")
    assert protocol_ran(label, record).startswith(ran)


def test_a_cast_that_breaks_the_sweeps_own_inputs_is_a_kernel_not_the_collective() -> None:
    """#46 item 11: a truncating fp32/fp64 -> bf16 cast makes a rounding case's expected values wrong before any
    collective runs: the sweep reads back what it meant to send and names the conversion kernel."""
    from types import SimpleNamespace

    import torch

    from pytest_gpuregress.faults import install_counted
    from pytest_gpuregress.scenarios import Setup, registry
    from pytest_gpuregress.scenarios.base import Case
    from pytest_gpuregress.scenarios.collectives import rank

    from ...conftest import make_record

    values = torch.tensor([16.1875, 3.0], dtype=torch.float64)  # 16.1875 rounds to 16.25 in bf16, cuts to 16.125
    assert rank._cast(values, torch.bfloat16, torch).tolist() == [16.25, 3.0]
    ctx = SimpleNamespace(rank=0, world_size=2, cleanup_hooks=[], config={})
    install_counted(["cast:mode=truncate_bf16"], ctx)
    try:
        with pytest.raises(rank.CastMismatch, match=r"first 16.1875: 16.125 where 16.25: a conversion kernel"):
            rank._cast(values, torch.bfloat16, torch)
    finally:
        for cleanup in ctx.cleanup_hooks:
            cleanup()
    case = plan.Case(op="all_reduce", variant="", reduce_op="sum", dtype="bf16r", n=8, in_place=True)
    record = make_record()
    record.results = {"cases": {case.id: {"cast_error": "rank 0: the cast float64 -> bfloat16 ...", "wrong": 3}}}
    found = registry()["collectives"].own_findings(Case(case.id, data=case.to_json()), record, Setup("cpu", "gloo", 2))
    assert [described(f) for f in found] == [
        f"[kernel] {case.describe(2)}: rank 0: the cast float64 -> bfloat16 ... (rule sweep-inputs)"]


def test_a_cpu_kernel_path_that_lacks_an_instruction_set_is_not_supported_and_no_other_refusal_is() -> None:
    """torch 2.13's bf16 attention on the AVX2 path of an AMX CPU: the path lacks the op (docs/found-on-real-stacks.md)."""
    said = "pack_vnni2 is only supported when avx512 is supported"
    assert NotSupported.kernel_path_lacks(RuntimeError(f"rank 0 raised RuntimeError: {said}")) == said
    for other in ("FP8 is only supported when compute capability >= 8.9", "Backend gloo does not support alltoall",
                  "mat1 and mat2 shapes cannot be multiplied"):
        assert NotSupported.kernel_path_lacks(RuntimeError(other)) is None, other

