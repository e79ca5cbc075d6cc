"""The sweep plan: exact inputs and results, sizes, ids, capabilities, merging and verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from pytest_gpuregress.scenarios.collectives import plan, protocol_groups
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
        avg = plan.expected_reduction(idx, world, dtype, "avg", _np_reduce, salt)
        assert _exact_in(dtype, avg) and avg.min() >= 1
        np.testing.assert_array_equal(avg * world, sum(avg_inputs))


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
    message = plan.verdict(case, merged, 2)
    assert message is not None
    for part in ("all_reduce AVG bf16 n=1024 (2 KiB) in place", "8 wrong elements", "8 of them in the last 16",
                 "on 1 of 3 repeats (intermittent)", "first wrong index 1016 on rank 1", "expected 5.0, got 0.0"):
        assert part in message
    assert plan.verdict(case, plan.merge_rank_results([{case.id: clean}])[case.id], 2) is None


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
