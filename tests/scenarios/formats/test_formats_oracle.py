"""The formats scenario's oracle (ml_dtypes), encode grid and behaviour naming. torch-free and fast.

The pinned codes come from the OCP 8-bit floating point specification (v1.0) and the OCP
microscaling (MX) specification (v1.0), and from AMD's fnuz formats: they check the oracle itself.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from pytest_gpuregress.scenarios.formats import grid, oracle, quantize
from pytest_gpuregress.scenarios.formats.catalog import FORMATS, SCHEMES

pytestmark = pytest.mark.cpu_sensitive  # .ci/run runs these again on a lower CPU kernel path

E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0, E2M1 = (FORMATS[f] for f in FORMATS)


def value(code: int, fmt_id: str) -> float:
    return float(oracle.decode(np.array([code], dtype=np.uint8), FORMATS[fmt_id])[0])


@pytest.mark.parametrize(("fmt_id", "code", "expected"), [
    ("e4m3fn", 0x7E, 448.0),  # OCP FP8: the largest E4M3 normal, S.1111.110
    ("e4m3fn", 0x7F, math.nan),  # S.1111.111 is E4M3's only NaN
    ("e4m3fn", 0x80, -0.0),  # negative zero
    ("e4m3fn", 0x01, 2.0**-9),  # the smallest subnormal
    ("e4m3fnuz", 0x80, math.nan),  # fnuz: 0x80 is the only NaN; no negative zero
    ("e4m3fnuz", 0x7F, 240.0),  # fnuz's largest value: exponent bias 8, not 7
    ("e4m3fnuz", 0x01, 2.0**-10),
    ("e5m2", 0x7B, 57344.0),  # OCP FP8: the largest E5M2 normal
    ("e5m2", 0x7C, math.inf),  # E5M2 keeps IEEE infinities
    ("e5m2fnuz", 0x7F, 57344.0),
    ("e5m2fnuz", 0x80, math.nan),
    ("e8m0fnu", 127, 1.0),  # OCP MX: the e8m0 scale's bias is 127
    ("e8m0fnu", 0, 2.0**-127),
    ("e8m0fnu", 0xFF, math.nan),
    ("e2m1fn", 0x7, 6.0),  # OCP MX: FP4 E2M1's largest value
    ("e2m1fn", 0x1, 0.5),  # its only subnormal
    ("e2m1fn", 0xF, -6.0),
])
def test_the_oracle_matches_the_specifications(fmt_id: str, code: int, expected: float) -> None:
    got = value(code, fmt_id)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected)


def test_oracle_limits_and_the_vendor_factor_of_two() -> None:
    assert oracle.limits(E4M3FNUZ).max == 240.0 and oracle.limits(E4M3FN).max == 448.0
    assert (oracle.limits(E4M3FN).emax, oracle.limits(E2M1).emax) == (8, 2)  # OCP MX emax_elem
    codes = oracle.all_codes(E4M3FN)
    normal = np.isfinite(oracle.decode(codes, E4M3FN)) & np.isfinite(oracle.decode(codes, E4M3FNUZ)) & (codes & 0x7F > 0)
    # The measured bug class: e4m3fn bytes read as e4m3fnuz are worth exactly half.
    assert np.all(oracle.decode(codes[normal], E4M3FNUZ) * 2 == oracle.decode(codes[normal], E4M3FN))
    assert oracle.value_ratio(oracle.decode(codes, E4M3FN), oracle.decode(codes, E4M3FNUZ)) == 0.5
    assert oracle.identify(codes, oracle.decode(codes, E4M3FNUZ), E4M3FN) is E4M3FNUZ


def test_encode_is_round_to_nearest_even_and_fp4_packs_low_nibble_first() -> None:
    x = np.array([464.0, 465.0, 500.0, 1.0625, 1.1875, 2.0**-10], dtype=np.float32)
    assert oracle.encode(x, E4M3FN).tolist() == [0x7E, 0x7F, 0x7F, 0x38, 0x3A, 0x00]  # 465 and 500 overflow to NaN
    assert oracle.encode(np.array([7.0, 5.0, 0.25], dtype=np.float32), E2M1).tolist() == [0x7, 0x6, 0x0]
    packed = oracle.pack_nibbles(np.array([0x1, 0xF, 0x7, 0x8], dtype=np.uint8))
    assert packed.tolist() == [0xF1, 0x87]
    assert oracle.unpack_nibbles(packed).tolist() == [0x1, 0xF, 0x7, 0x8]


def test_the_grid_holds_what_the_issue_lists() -> None:
    values = grid.encode_grid()
    listed = {240.0, -240.0, 448.0, -448.0, 57344.0, -57344.0, 464.0, 465.0, math.inf, -math.inf}
    assert listed <= set(values.tolist()) and np.isnan(values[-1])
    for fmt in FORMATS.values():  # the values just below and above each maximum, and the subnormals
        top = np.float32(oracle.limits(fmt).max)
        assert {np.nextafter(top, np.float32(0)), np.nextafter(top, np.float32(np.inf))} <= set(values.tolist())
        if oracle.limits(fmt).smallest_subnormal < oracle.limits(fmt).smallest_normal:
            assert oracle.limits(fmt).smallest_subnormal / 2 in values  # a tie with zero
    assert grid.grid_digest() == grid.grid_digest()


def test_behaviour_classes_follow_the_oracle() -> None:
    assert grid.behaviour_class(464.0, E4M3FN) is None  # the tie rounds down to 448: in range
    assert grid.behaviour_class(465.0, E4M3FN) == "overflow"
    assert grid.behaviour_class(248.0, E4M3FNUZ) == "overflow"  # 240's code is odd: the tie overflows
    assert grid.behaviour_class(-1e30, E5M2) == "negative overflow"
    assert grid.behaviour_class(7.0, E2M1) is None  # fp4 has no NaN: the oracle saturates, as OCP MX says
    assert grid.behaviour_class(-1.0, E8M0) == "negative" and grid.behaviour_class(-0.0, E8M0) == "negative zero"
    assert grid.behaviour_class(math.nan, E4M3FN) == "NaN"


def _saturating(values: np.ndarray, fmt: object) -> np.ndarray:
    """What torch 2.13 does for e4m3fn, as measured: clamp, then round to nearest even."""
    top = np.float32(oracle.limits(fmt).max)  # type: ignore[arg-type]
    clipped = np.where(np.isnan(values), values, np.clip(values, -top, top))
    return oracle.encode(clipped, fmt)  # type: ignore[arg-type]


def test_a_behaviour_change_is_reported_by_name() -> None:
    values = grid.encode_grid()
    saturating = grid.behaviours(values, _saturating(values, E4M3FN), E4M3FN)
    nan_on_overflow = grid.behaviours(values, oracle.encode(values, E4M3FN), E4M3FN)
    assert grid.describe(saturating["overflow"]) == "saturates to 448"
    assert grid.behaviour_changes(saturating, saturating, E4M3FN) == []
    assert grid.describe(nan_on_overflow["overflow"]) == grid.describe(nan_on_overflow["negative overflow"]) == "gives NaN"
    changes = grid.behaviour_changes(saturating, nan_on_overflow, E4M3FN)
    changed = {m[1]: (m[2], m[3]) for m in (re.fullmatch(r"(.+) to e4m3fn now (.+); the reference (.+)", c)
                                            for c in changes) if m}
    assert len(changed) == len(changes), changes  # each change names its class, what it does now and did before
    assert changed["overflow"] == ("gives NaN", "saturated to 448")
    assert changed["negative overflow"] == ("gives NaN", "saturated to -448")
    assert not any(c.startswith("NaN") for c in changes)  # NaN stays NaN either way


def test_in_range_values_must_match_the_oracle_bit_for_bit() -> None:
    values = grid.encode_grid()
    good = _saturating(values, E4M3FN)
    compared, wrong = grid.in_range_mismatches(values, good, E4M3FN)
    assert compared > 80 and wrong == []
    truncating = good.copy()
    truncating[values.tolist().index(464.0)] = 0x7D  # 464 rounded down past the tie
    assert [w["value"] for w in grid.in_range_mismatches(values, truncating, E4M3FN)[1]] == [464.0]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_the_oracle_quantizers_round_trip_closely(scheme: str) -> None:
    w = np.random.default_rng(0).normal(0, 0.02, (8, 80)).astype(np.float32)
    q = quantize.quantize(w, SCHEMES[scheme])
    back = quantize.dequantize(q.codes, q.scale, FORMATS[SCHEMES[scheme].element], SCHEMES[scheme].block)
    limit = 0.3 if "fp4" in scheme else 0.13  # fp4 keeps 1 mantissa bit; OCP's floor rule can saturate
    assert np.abs(back - w).max() <= limit * np.abs(w).max()


def test_the_conversion_to_fnuz_keeps_every_value() -> None:
    w = np.concatenate([np.random.default_rng(1).normal(0, 1, 62), [-0.0, -1e-12]]).astype(np.float32)
    source = quantize.per_tensor(w, E4M3FN)
    assert 0x80 in source.codes  # negative zeros to rewrite
    converted = quantize.fn_to_fnuz(source, E4M3FN, E4M3FNUZ)
    assert 0x80 not in converted.codes
    # Every value survives (== counts -0.0 and 0.0 as equal: the rewrite turns one into the other).
    assert np.array_equal(quantize.dequantize(converted.codes, converted.scale, E4M3FNUZ, None),
                          quantize.dequantize(source.codes, source.scale, E4M3FN, None))


@pytest.mark.parametrize("fmt_id", list(FORMATS))
def test_the_vectorised_overflow_test_agrees_with_the_classes(fmt_id: str) -> None:
    fmt, values = FORMATS[fmt_id], grid.encode_grid()
    classes = [grid.behaviour_class(float(x), fmt) for x in values]
    expected = [c in ("overflow", "negative overflow", "+inf", "-inf") for c in classes]
    assert grid.overflows(values, fmt).tolist() == expected
