"""Verdicts of the checkpoint scenario, from launch records. torch-free: unit-tests run in milliseconds.

Every finding is one line that starts with ``<case>:`` and names the piece of state that differs (a
parameter, ``optimizer.exp_avg`` of a parameter, ``rng.numpy``, ...); triage names its component.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GpuRegressError
from ...findings import CheckFinding, Problem
from ...reference.record import RunRecord
from ...reference.store import MANIFEST, ReferenceLocation, read_reference
from ...stack import fingerprint as fp
from ..shared.state_pieces import differs, piece_digest
from ..shared.state_pieces import order as piece_order

SHOWN = 4  # findings shown per piece; the rest are counted


def prefixed(case: str, messages: list[str]) -> list[Problem]:
    return [CheckFinding("checkpoint", f"{case}: {m}") for m in messages]


def part_findings(case: str, part: dict[str, Any] | None) -> list[Problem]:
    """The findings a rank recorded for one part; a part that did not run cannot have passed."""
    if not part or not part.get("ran"):
        return prefixed(case, ["did not run on rank 0 (no result in the record)"])
    return prefixed(case, list(part.get("findings", [])))


# --- portability ---------------------------------------------------------------------------------------


def read_bundle(folder: Path) -> RunRecord:
    """The checkpoint scenario's reference at ``folder``, verified against its manifest."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise GpuRegressError(f"{folder}: no portable checkpoint here (no {MANIFEST})\n  fix: record one with "
                              "pytest --gpuregress --gpuregress-record 'gpuregress::checkpoint*', or point "
                              "--gpuregress-portable-checkpoint at a reference folder of the checkpoint scenario")
    record = read_reference(ReferenceLocation(folder.parent.parent, folder.parent.name, folder.name))
    if "logits" not in record.arrays or "bundle" not in record.results.get("full_state_dict", {}):
        raise GpuRegressError(f"{folder}: a reference without the checkpoint scenario's bundle (logits and checksums)"
                              "\n  fix: point --gpuregress-portable-checkpoint at a reference of the checkpoint scenario")
    return record


def same_numerics(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal numerics fingerprints, collectives aside: evaluating a checkpoint runs none."""
    return not [c for c in fp.numerics_diff(a, b) if not c[0].startswith("comm.")]


def describe_stack(fingerprint: dict[str, Any]) -> str:
    device = fingerprint.get("device", {})
    versions = fingerprint.get("versions", {})
    where = (device.get("cpu_model") if device.get("kind") == "cpu" else device.get("name")) or "an unknown device"
    return f"{where}, torch {versions.get('torch')}"


# --- sharded: full-tensor hashes before the save and after the load --------------------------------------


def _permutation(saved: list[str], loaded: list[str]) -> list[int] | None:
    """The order in which the saved chunks come back, when the loaded tensor is the saved one reordered."""
    if len(saved) != len(loaded) or sorted(saved) != sorted(loaded) or saved == loaded or len(set(saved)) != len(saved):
        return None
    return [saved.index(h) for h in loaded]


def reshard_findings(saved: dict[str, Any], loaded: dict[str, Any], n: int, m: int) -> list[str]:
    """Weights and optimizer state after a save at ``n`` ranks and a load at ``m``, piece by piece."""
    out: list[str] = []
    for piece in sorted(set(saved) | set(loaded)):
        before, after = saved.get(piece, {}), loaded.get(piece, {})
        lines = []
        for name in sorted(set(before) | set(after)):
            if name not in after:
                lines.append(f"{piece} of {name} is missing after the load")
            elif name not in before:
                lines.append(f"{piece} of {name} is there after the load but was never saved")
            elif before[name]["sha256"] != after[name]["sha256"]:
                order = _permutation(before[name]["chunks"], after[name]["chunks"])
                shape = before[name]["shape"]
                if order is not None:
                    why = (f"its {len(order)} chunks along dim 0 come back in the order {order}: chunks permuted when "
                           f"resharding {n} -> {m}")
                else:
                    same = sum(a == b for a, b in zip(before[name]["chunks"], after[name]["chunks"]))
                    why = (f"{len(before[name]['chunks']) - same} of its {len(before[name]['chunks'])} chunks along dim 0 "
                           "differ")
                lines.append(f"{piece} of {name} {shape}: the full-tensor hash differs after saving at world size {n} "
                             f"and loading at {m}; {why}")
        out += lines[:SHOWN]
        if len(lines) > SHOWN:
            out.append(f"{piece}: ... and {len(lines) - SHOWN} more tensors like these")
    return out


# --- resume: the loss curves and the state at the resume boundary ---------------------------------------


LOSS_TOLERANCE = 1e-6  # the tolerant lane's fp32 loss limit without an envelope (comparison/compare.py)


def _curve_deviation(expected: list[float], got: list[float], exact: bool) -> tuple[np.ndarray, ...]:
    """(expected, got, relative deviation, where it is a difference) as float64 arrays, of curves of one length."""
    a, b = np.asarray(expected, dtype=np.float64), np.asarray(got, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        dev = np.abs(a - b) / np.maximum(np.abs(a), np.finfo(np.float64).tiny)
    return a, b, dev, (a.view(np.int64) != b.view(np.int64)) if exact else ~(dev <= LOSS_TOLERANCE)


def first_curve_difference(expected: list[float], got: list[float], exact: bool) -> int | None:
    """The first step at which ``got`` differs from ``expected`` as curve_findings judges it; None: none does (or
    the lengths differ)."""
    if len(expected) != len(got):
        return None
    bad = _curve_deviation(expected, got, exact)[3]
    return int(np.argmax(bad)) if bad.any() else None


def curve_findings(expected: list[float], got: list[float], exact: bool, k: int | None = None,
                   what: str = "the resumed run differs from the straight run") -> list[str]:
    """A loss curve against the one it must equal: bitwise (``exact``) or within LOSS_TOLERANCE.
    ``k``: the step at which the run resumed, to say where the first difference lies."""
    if len(expected) != len(got):
        return [f"loss curve: {len(expected)} steps expected, {len(got)} run"]
    a, b, dev, bad = _curve_deviation(expected, got, exact)
    if not bad.any():
        return []
    step = int(np.argmax(bad))
    where = ""
    if k is not None:
        after = step - k
        where = (" (the first step after the resume)" if after == 0 else
                 " (before the resume: the first half already differs)" if after < 0 else
                 f" ({after} step{'s' if after > 1 else ''} after the resume)")
    lane = "bitwise (a deterministic stack)" if exact else f"within {LOSS_TOLERANCE:g} relative (tolerant lane)"
    return [f"loss curve: {what} from step {step}{where}: expected {float(a[step])!r}, got {float(b[step])!r} "
            f"(relative {dev[step]:.3g}); {int(bad.sum())} of {len(a)} steps differ, where they must agree {lane}"]


def boundary_table(straight: dict[str, dict[str, str]], saved: dict[str, dict[str, str]],
                   loaded: dict[str, dict[str, str]], k: int) -> tuple[list[str], list[str]]:
    """(the table's lines, the pieces whose loaded state is not the saved state). Columns: the straight run after
    k steps, the first run at its save, the second after its load. Loaded against saved is the checkpoint's job,
    exact on any stack; saved against straight differs only where the stack is not deterministic."""
    pieces = sorted(set(straight) | set(saved) | set(loaded), key=piece_order)
    width = max(len(p) for p in pieces) if pieces else 10
    lines = [f"state at the resume boundary (before step {k}), sha256 per piece of state:",
             f"  {'piece':<{width}}  {'straight':<12}  {'saved':<12}  {'loaded':<12}  loaded vs saved"]
    differing = []
    for piece in pieces:
        a, b, c = straight.get(piece, {}), saved.get(piece, {}), loaded.get(piece, {})
        verdict = differs(piece, b, c)
        if verdict:
            differing.append(piece)
        lines.append(f"  {piece:<{width}}  {piece_digest(a)[:12]:<12}  {piece_digest(b)[:12]:<12}  "
                     f"{piece_digest(c)[:12]:<12}  {'DIFFERS: ' + verdict if verdict else 'same'}")
    return lines, differing


def resume_findings(straight: RunRecord, first: RunRecord, second: RunRecord, k: int) -> tuple[list[str], list[str]]:
    """(findings, the boundary table) of the resume case: a failed load, each piece of state that differs,
    the curves. The table comes with findings only."""
    error = second.results.get("load_error")
    if error:
        return [f"loading the checkpoint in new processes failed: {error}"], []
    at_k, saved, loaded = straight.results["boundary"], first.results["boundary"], second.results["boundary"]
    table, differing = boundary_table(at_k, saved, loaded, k)
    exact = bool(straight.results.get("deterministic"))
    out = [f"{piece} after the load is not the saved state ({differs(piece, saved.get(piece, {}), loaded.get(piece, {}))})"
           for piece in differing]
    resumed = list(first.series.get("loss", [])) + list(second.series.get("loss", []))
    out += curve_findings(straight.series.get("loss", []), resumed, exact, k)
    if exact:  # on a deterministic stack the first half must repeat the straight run exactly
        out += [f"{piece} at the save differs from the straight run's after {k} steps, on a deterministic stack "
                f"({differs(piece, at_k[piece], saved.get(piece, {}))})"
                for piece in sorted(at_k, key=piece_order) if differs(piece, at_k[piece], saved.get(piece, {}))]
    return out, (table if out else [])


def same_processes(first: RunRecord, second: RunRecord) -> bool:
    """Whether any rank of the second half ran in the process of the first half (in place, or a reused worker)."""
    a, b = first.results.get("pid", {}), second.results.get("pid", {})
    return any(a.get(rank) == pid for rank, pid in b.items())
