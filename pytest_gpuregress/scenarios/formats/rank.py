"""The formats scenario on one rank: measure what the device does (decode, encode, quantized round trip, io,
scaled_mm); the session judges. Rank side. No training and no collectives but DCP's own: each rank checks its
own device, and the session compares ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...reference.record import RunRecord
from ..base import RankContext
from . import device, grid, roundtrip, scaled_mm
from .catalog import FORMATS, SESSION_ONLY, Format


def decode_all(fmt: Format, dev: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, device values) for every code of ``fmt``."""
    if fmt.packed:
        packed = torch.arange(256, dtype=torch.uint8, device=dev).view(torch.float4_e2m1fn_x2)
        codes = device.unpack_fp4(packed)
    else:
        codes = torch.arange(fmt.code_count, dtype=torch.uint8, device=dev)
    return codes.cpu().numpy(), device.decode(codes, fmt).cpu().numpy()


def measure(plan: dict[str, Any], dev: str, values: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """(arrays, unavailable formats, errors by case id) of the decode and encode parts."""
    arrays: dict[str, np.ndarray] = {}
    unavailable: dict[str, str] = {}
    errors: dict[str, str] = {}
    for fmt in (FORMATS[f] for f in FORMATS if f in plan["decode"] or f in plan["encode"]):
        reason = device.missing(fmt)
        if reason:
            unavailable[fmt.id] = reason
            continue
        for part in (p for p in ("decode", "encode") if fmt.id in plan[p]):
            try:
                arrays.update(_measure_part(part, fmt, dev, values))
            except RuntimeError as exc:  # no kernel for this format on this device: a finding of its case
                errors[f"{part}-{fmt.id}"] = f"{type(exc).__name__}: {exc}"
    return arrays, unavailable, errors


def _measure_part(part: str, fmt: Format, dev: str, values: np.ndarray) -> dict[str, np.ndarray]:
    """A decode's codes and device values, or an encode's device codes of the grid ``values``."""
    if part == "decode":
        codes, decoded = decode_all(fmt, dev)
        return {f"decode/{fmt.id}/codes": codes, f"decode/{fmt.id}": decoded}
    return {f"encode/{fmt.id}": device.cast(torch.from_numpy(values).to(dev), fmt).cpu().numpy()}


def run(ctx: RankContext) -> RunRecord:
    plan: dict[str, Any] = ctx.config["run"]
    values = grid.encode_grid()
    arrays, unavailable, errors = measure(plan, ctx.device, values)
    arrays["encode/grid"] = values
    results: dict[str, Any] = {"device": {"torch": torch.__version__, "name": ctx.device,
                                          "native_fp4_cast": device.native_fp4_cast()},
                               "unavailable": unavailable, "errors": errors}
    ctx.progress("decode and encode done")
    if plan["quantized"]:
        results["quantized"], results["inspect"], logits, io = roundtrip.run(
            plan["quantized"], ctx.config, ctx.device, ctx.run_dir, ctx.progress, plan.get("io", []))
        arrays.update(logits)
        if io:
            results["io"] = io
    if plan["scaled_mm"]:
        results["scaled_mm"] = scaled_mm.run(ctx.device)
    results["session"] = {k: ctx.config.get(k) for k in SESSION_ONLY}
    return RunRecord(scenario="formats", config={k: v for k, v in ctx.config.items() if k not in SESSION_ONLY},
                     platform_key="", world_size=ctx.world_size, results=results, arrays=arrays)
