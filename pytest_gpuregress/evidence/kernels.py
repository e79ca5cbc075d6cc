"""Kernel inventories compared: ops on other kernels than in the reference, and GPU-run ops that fell back
to the host. Torch- and numpy-free; training/kernels.py takes the inventory. A changed kernel is reported, not
failed (upgrades change kernels legitimately); floating-point work on the host during a GPU run always fails.
"""

from __future__ import annotations

from typing import Any

from ..findings import CheckFinding
from ..reference.record import RunRecord

INVENTORY = "kernels"
HOST_OPS = "host_ops"
SHOWN = 12  # changed ops listed in a report; the rest are counted


def _implementation(entry: dict[str, Any]) -> list[str]:
    """What an op ran as: its device kernels where there are any (GPUs), else the aten ops it dispatched to,
    else the op itself (a CPU kernel of its own)."""
    return list(entry.get("kernels") or []) + [op.removeprefix("aten::") for op in entry.get("dispatch") or []]


def changes(reference: RunRecord, record: RunRecord) -> list[str] | None:
    """One line per op whose kernels differ, e.g. "aten::scaled_dot_product_attention:
    _scaled_dot_product_flash_attention_for_cpu -> _scaled_dot_product_attention_math";
    None when either record has no inventory (a reference recorded before inventories, or profiling off)."""
    old, new = reference.results.get(INVENTORY), record.results.get(INVENTORY)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    return [line for op in sorted(set(old) | set(new)) if (line := _change(op, old, new)) is not None]


def _change(op: str, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """How ``op`` runs now against the reference's inventory ``old``; None where its kernels are the same."""
    if op not in new:
        return f"{op}: no longer called (was {_joined(_implementation(old[op]))})"
    if op not in old:
        return f"{op}: newly called, runs as {_joined(_implementation(new[op]))}"
    before, after = _implementation(old[op]), _implementation(new[op])
    if before == after:
        return None
    gone = [k for k in before if k not in after]
    came = [k for k in after if k not in before]
    return f"{op}: {_joined(gone)} -> {_joined(came)}"


def _joined(names: list[str]) -> str:
    return ", ".join(names) if names else "its own kernel"


def host_op_problems(record: RunRecord) -> list[CheckFinding]:
    """One finding naming every op that ran on the host while the scenario runs on an accelerator."""
    host = record.results.get(HOST_OPS)
    if not isinstance(host, dict) or not host.get("ops"):
        return []
    ops = host["ops"]
    listed = "; ".join(f"{op} ({entry['calls']} calls, {entry['dtype']} {entry['shape']})"
                       for op, entry in sorted(ops.items()))
    return [CheckFinding("host-ops", f"{len(ops)} op(s) ran on the CPU while {record.scenario!r} runs on "
                         f"{host['accelerator']}: {listed}. A missing device kernel made them fall back to the host: "
                         "the numbers may be right, the throughput is not. Check the build of torch (and of the "
                         "extension that should provide the op)")]


def report_lines(found: list[str] | None, why: str = "") -> list[str]:
    """The kernel changes for a failure report or a warning (at most ``SHOWN`` ops, the rest counted);
    ``why`` goes into the heading, e.g. the option that makes them fail."""
    if not found:
        return []
    shown = [f"  {line}" for line in found[:SHOWN]]
    more = [f"  ... and {len(found) - SHOWN} more (all of them: the kept run's record.json, results.kernels)"] \
        if len(found) > SHOWN else []
    return [f"kernels changed since the reference ({len(found)} ops{'; ' + why if why else ''}):", *shown, *more]
