"""The encode grid, and what the device does with the values outside a format's range. torch-free.

In-range grid values must encode like the oracle's round-to-nearest-even. The rest (overflow, ±inf, NaN) have
no single right answer (OCP allows saturating or not, and releases switched: pytorch/ao#1912,
jax-ml/ml_dtypes#260), so what the device does is a *behaviour*, compared with the reference by name.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from . import oracle
from .catalog import FORMATS, Format

INF = float("inf")
# From the issue and docs/faults.md section 2: the maxima of e4m3fnuz, e4m3fn and e5m2, the
# e4m3fn rounding tie 464 (rounds to 448) and 465 (overflows), 500 (measured: torch 2.13
# saturates it to 448 in e4m3fn), infinities, NaN and both zeros.
LITERALS = (240.0, -240.0, 448.0, -448.0, 57344.0, -57344.0, 464.0, 465.0, 500.0, INF, -INF, math.nan, 0.0, -0.0)


def _after(x: float, toward: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(toward)))


def _format_points(fmt: Format) -> list[float]:
    """Values just below and above the maximum, the overflow tie, subnormals, and ties at 1."""
    lim = oracle.limits(fmt)
    # Halfway between the maximum and the value one step above it (which the format lacks): RNE
    # overflows from here (or at it, when the maximum's code is odd). One step is 2**(emax - mantissa bits).
    tie_over = lim.max + 2.0 ** (lim.emax - lim.mantissa_bits - 1)
    points = [lim.max, -lim.max, _after(lim.max, 0), _after(lim.max, INF),
              tie_over, -tie_over, _after(tie_over, 0), _after(tie_over, INF), -_after(tie_over, INF),
              lim.smallest_normal, _after(lim.smallest_normal, 0)]
    step = 2.0 ** -lim.mantissa_bits  # the spacing just above 1
    points += [1 + step / 2, -(1 + step / 2), _after(1 + step / 2, INF), 1 + 3 * step / 2]  # ties at 1
    s = lim.smallest_subnormal
    if s < lim.smallest_normal:
        # s/2 ties with zero (rounds to even, 0); 1.5 s ties between codes 1 and 2 (rounds to 2 s)
        points += [s, -s, s / 2, -s / 2, _after(s / 2, INF), 1.5 * s, 2.5 * s, lim.smallest_normal - s]
    return points


def encode_grid() -> np.ndarray:
    """The fixed grid: the literals and every format's points, as float32, each once, NaN last."""
    values = np.array([*LITERALS, *(p for fmt in FORMATS.values() for p in _format_points(fmt))], dtype=np.float32)
    _, first = np.unique(values.view(np.uint32), return_index=True)  # by bits: keeps -0.0 beside 0.0
    unique = values[np.sort(first)]
    return np.concatenate([np.sort(unique[~np.isnan(unique)], kind="stable"), np.array([np.nan], dtype=np.float32)])


def grid_digest() -> str:
    """Stored in the config: a reference made on another grid is refused as foreign, not misread."""
    return f"{zlib.crc32(encode_grid().tobytes()):08x}"


def behaviour_class(x: float, fmt: Format) -> str | None:
    """None when ``x`` is in range for ``fmt`` (compared with the oracle); else the name of its class."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    if np.isfinite(oracle.decode(oracle.encode(np.array([x]), fmt), fmt)[0]):
        return None
    if x == 0:
        return "negative zero" if math.copysign(1.0, x) < 0 else "zero"
    magnitude = oracle.decode(oracle.encode(np.array([abs(x)]), fmt), fmt)[0]
    if not np.isfinite(magnitude):
        return "overflow" if x > 0 else "negative overflow"
    return "negative"  # e8m0 has no sign bit


def overflows(values: np.ndarray, fmt: Format) -> np.ndarray:
    """Elementwise: ±inf, or a finite non-zero value whose magnitude rounds past ``fmt``'s maximum
    (the classes "overflow", "negative overflow", "+inf" and "-inf")."""
    x = np.asarray(values, dtype=np.float32)
    magnitude = oracle.decode(oracle.encode(np.abs(x), fmt), fmt)
    return np.isinf(x) | (np.isfinite(x) & (x != 0) & ~np.isfinite(magnitude))


def number(v: float) -> str:
    """448, -240, 0.5, 2^-127: short and exact for the values these formats hold."""
    if not math.isfinite(v):
        return repr(v)
    if v == int(v) and abs(v) < 1e7:
        return str(int(v)) if v or math.copysign(1.0, v) > 0 else "-0"
    mantissa, exponent = math.frexp(abs(v))
    if mantissa == 0.5 and abs(exponent) > 12:
        return f"{'-' if v < 0 else ''}2^{exponent - 1}"
    return f"{v:.9g}"


def outcome(x: float, code: int, fmt: Format) -> str:
    """What the device made of an out-of-range value, as a short stable label."""
    v = float(oracle.decode(np.array([code]), fmt)[0])
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if x < 0 and code == int(oracle.encode(np.array([abs(x)]), fmt)[0]):
        return "magnitude"  # e8m0, which has no sign: the code of |x|
    if abs(v) == oracle.limits(fmt).max:
        return f"saturate {number(v)}"
    return f"value {number(v)}"


def _verb(label: str, past: bool) -> str:
    kind, _, value = label.partition(" ")
    if kind == "saturate":
        return f"{'saturated' if past else 'saturates'} to {value}"
    if kind == "magnitude":
        return "dropped the sign" if past else "drops the sign"
    shown = value if kind == "value" else label
    return f"{'gave' if past else 'gives'} {shown}"


def describe(entries: list[dict[str, Any]], past: bool = False) -> str:
    """'saturates to 448', or per value when they differ: 'gives NaN for 465; saturates to 448 for 500'."""
    groups: dict[str, list[float]] = {}
    for entry in entries:
        groups.setdefault(entry["outcome"], []).append(entry["value"])
    if len(groups) == 1:
        return _verb(next(iter(groups)), past)
    return "; ".join(f"{_verb(label, past)} for {', '.join(number(x) for x in xs)}" for label, xs in groups.items())


CLASSES = ("overflow", "negative overflow", "+inf", "-inf", "NaN", "zero", "negative zero", "negative")


def behaviours(values: np.ndarray, codes: np.ndarray, fmt: Format) -> dict[str, list[dict[str, Any]]]:
    """Class -> [{value, code, outcome}] for the grid values outside ``fmt``'s range, classes in CLASSES order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for x, code in zip(values.tolist(), codes.tolist()):
        name = behaviour_class(x, fmt)
        if name is not None:
            out.setdefault(name, []).append({"value": x, "code": int(code), "outcome": outcome(x, int(code), fmt)})
    return {name: out[name] for name in CLASSES if name in out}


def in_range_mismatches(values: np.ndarray, codes: np.ndarray, fmt: Format) -> tuple[int, list[dict[str, Any]]]:
    """(in-range values compared, those whose device code differs from the oracle's RNE code)."""
    in_range = np.array([behaviour_class(x, fmt) is None for x in values.tolist()], dtype=bool)
    expected = oracle.encode(values, fmt)
    wrong = in_range & ~oracle.same_codes(expected, codes, fmt)
    rows = [{"value": float(values[i]), "oracle_code": int(expected[i]), "device_code": int(codes[i]),
             "oracle": float(oracle.decode(expected[i : i + 1], fmt)[0]),
             "device": float(oracle.decode(codes[i : i + 1], fmt)[0])} for i in np.nonzero(wrong)[0]]
    return int(in_range.sum()), rows


def behaviour_changes(reference: dict[str, list[dict[str, Any]]], run: dict[str, list[dict[str, Any]]],
                      fmt: Format) -> list[str]:
    """Each changed class by name: 'overflow to e4m3fn now gives NaN; the reference saturated to 448'."""
    changes = []
    for name in [*reference, *(n for n in run if n not in reference)]:
        before, now = reference.get(name), run.get(name)
        if before is None or now is None:
            changes.append(f"{name} to {fmt.id}: {'only this run' if before is None else 'only the reference'} has "
                           "grid values in this class (the grid changed); re-record the reference")
        elif describe(now) != describe(before):
            changes.append(f"{name} to {fmt.id} now {describe(now)}; the reference {describe(before, past=True)}")
    return changes
