"""Number-format faults, installed on a rank: the bug classes of docs/faults.md section 2.

Each mode (KINDS["format"] says what it does) intercepts one ``formats.<function>`` fault point
(scenarios/formats/device.py); the ``loader_*`` modes act in the stack's own loaders instead (faults/loaders.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..fault_points import intercept
from . import FaultSpec
from .firing import Firing

Wrapper = Callable[[Callable[..., Any], FaultSpec, Firing], Callable[..., Any]]


def install_format(spec: FaultSpec, ctx: Any) -> Firing:
    mode = spec.get("mode")
    if mode in LOADER_MODES:  # in the stack's loaders, not in the scenario's device functions
        from . import loaders

        return loaders.install(spec, ctx)
    name, wrap = PATCHES[mode]
    firing = Firing(spec.text)  # calls whose result the bug changed
    ctx.cleanup_hooks.append(intercept(f"formats.{name}", lambda original: wrap(original, spec, firing)))
    return firing


def _read_fn_as_fnuz(decode: Callable[..., Any], spec: FaultSpec, firing: Firing) -> Callable[..., Any]:
    from ..scenarios.formats.catalog import FORMATS

    def read(codes: Any, fmt: Any) -> Any:
        if fmt.id != "e4m3fn":
            return decode(codes, fmt)
        firing.fire()
        return decode(codes, FORMATS["e4m3fnuz"])

    return read


def _keep_0x80(convert: Callable[..., Any], spec: FaultSpec, firing: Firing) -> Callable[..., Any]:
    def convert_without_rewrite(codes: Any, scale: Any) -> Any:
        firing.fire()
        return codes.clone(), scale * 2

    return convert_without_rewrite


def _fnuz_max_448(format_max: Callable[..., Any], spec: FaultSpec, firing: Firing) -> Callable[..., Any]:
    def wrong_max(fmt: Any) -> float:
        if fmt.id != "e4m3fnuz":
            return format_max(fmt)
        firing.fire()
        return 448.0

    return wrong_max


def _flip_overflow(cast: Callable[..., Any], spec: FaultSpec, firing: Firing) -> Callable[..., Any]:
    """Overflowing values (as the oracle classifies them: past the rounding range, or ±inf) that the
    real cast saturated now give NaN, or inf where the format has it; those it made NaN or inf now
    saturate to ±max."""
    import numpy as np
    import torch

    from ..scenarios.formats import grid, oracle
    from ..scenarios.formats.catalog import FORMATS

    target = FORMATS[spec.get("format", "e4m3fn")]

    def flipped(values: Any, fmt: Any) -> Any:
        codes = cast(values, fmt)
        if fmt.id != target.id:
            return codes
        x = values.detach().cpu().numpy().reshape(-1)
        over = grid.overflows(x, fmt)
        if not over.any():
            return codes
        out = codes.cpu().numpy().reshape(-1).copy()
        got = oracle.decode(out, fmt)
        top = oracle.encode(np.where(x < 0, -1, 1) * np.float32(oracle.limits(fmt).max), fmt)
        past = oracle.encode(np.where(x < 0, -np.inf, np.inf).astype(np.float32), fmt)  # NaN or inf
        saturated = np.abs(got) == oracle.limits(fmt).max
        out[over] = np.where(saturated, past, top)[over]
        firing.fire()
        return torch.from_numpy(out.reshape(codes.shape)).to(codes.device)

    return flipped


def _mx_off(exponent: Callable[..., Any], spec: FaultSpec, firing: Firing) -> Callable[..., Any]:
    by = int(spec.get("by", 1))

    def off(amax: Any, fmt: Any) -> Any:
        firing.fire()
        return exponent(amax, fmt) + by

    return off


LOADER_MODES = ("loader_fn_as_fnuz", "loader_e5m2_as_e4m3fn", "loader_bf16_as_fp16")  # faults/loaders.py MODES
# mode -> (the device function it intercepts: fault point formats.<function>, the wrapper)
PATCHES: dict[str, tuple[str, Wrapper]] = {
    "fn_as_fnuz": ("decode", _read_fn_as_fnuz),
    "keep_0x80": ("fn_to_fnuz", _keep_0x80),
    "fnuz_max_448": ("format_max", _fnuz_max_448),
    "flip_overflow": ("cast", _flip_overflow),
    "mx_scale_off_by_one": ("mx_scale_exponent", _mx_off),
}
