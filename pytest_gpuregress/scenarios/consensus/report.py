"""The vote in words: who each device is, where it differs and by how much, what to do, the table. Torch-free."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ...findings import CheckFinding
from ...stack.device_identity import node_label
from ...stack.fingerprint import describe_change
from .digest import BYTES_PER_TENSOR, split_name
from .group_key import describe_key, key_diff
from .vote import AGREES, DISSENTS, NO_MAJORITY, Device, Difference, Group, Vote, first_difference

PART_NAMES = {"train": "training", "gemm": "GEMM/reduction battery", "cast": "format casts"}
RERUN = "pytest --gpuregress --gpuregress-consensus 'gpuregress::consensus*'"


class ConsensusStackSplit(UserWarning):
    """Devices of one model run another stack than the rest: a node the upgrade missed, or one rolled out early."""


# ---- who and where ------------------------------------------------------------------------------


def device_label(identity: dict[str, Any]) -> str:
    """``local 3 (cuda:3, smi GPU 5, bus 0000:18:00.0, uuid GPU-..., serial ...)``; a CPU rank is a process."""
    local = identity.get("local_rank")
    if identity.get("device", "cpu") == "cpu":
        return f"local {local} (cpu process, rank {identity.get('rank')})"
    ids = [identity["device"]]
    if identity.get("smi_index") is not None:
        ids.append(f"smi GPU {identity['smi_index']}")
    ids += [f"{label} {identity[k]}" for k, label in (("bus_id", "bus"), ("uuid", "uuid"), ("serial", "serial"))
            if identity.get(k)]
    return f"local {local} ({', '.join(ids)})"


def where(device: Device) -> str:
    return f"{device_label(device.identity)} on {node_label(device.identity)}"


# ---- what differs -------------------------------------------------------------------------------


def tensor_label(name: str) -> str:
    """``train|3|grad 0.weight`` -> ``training step 3, grad 0.weight``."""
    part, step, tensor = split_name(name)
    where_in = PART_NAMES.get(part, part) + (f" step {step}" if step is not None else "")
    return f"{where_in}, {tensor}"


def _ulps(ours: float, theirs: float, dtype: str) -> int | None:
    """How many units in the last place of ``dtype`` separate two scalars (numpy's types only)."""
    numpy_type = {"float32": np.float32, "float64": np.float64, "float16": np.float16}.get(dtype)
    if numpy_type is None or not (np.isfinite(ours) and np.isfinite(theirs)):
        return None
    return int(round((ours - theirs) / abs(float(np.spacing(numpy_type(theirs))))))


def amount(difference: Difference, kind: str) -> str:
    """By how much: a scalar's two values and their ulp distance, else the float64 sums and their relative gap."""
    dtype, _, shape = kind.partition("[")
    if difference.ours == difference.theirs:  # -0 for 0, a NaN's payload, or elements that trade places
        text = "other bits, equal float64 sums"
    elif shape == "]":  # a scalar: the loss
        ulps = _ulps(difference.ours, difference.theirs, dtype)
        text = f"{difference.ours:.9g} vs {difference.theirs:.9g}" + (f" ({ulps:+d} ulp {dtype})" if ulps else "")
    else:
        text = f"sum {difference.ours:.9g} vs {difference.theirs:.9g} ({difference.relative:.2g} of its magnitude)"
    return f"{text}, {difference.differing} of {difference.total} tensors differ"


def difference_text(vote: Vote, difference: Difference) -> str:
    if difference.index is None:
        return "another workload: its list of tensors differs (another torch or plugin version on that device?)"
    index = difference.index
    kind = vote.kinds[index] if index < len(vote.kinds) else "?["
    name = vote.names[index] if index < len(vote.names) else f"tensor #{index}"
    return f"{tensor_label(name)} ({kind}): {amount(difference, kind)}"


# ---- what to do --------------------------------------------------------------------------------


def diagnostics(key: dict[str, Any]) -> str:
    """The node's own diagnostics, by vendor."""
    if key.get("device.kind") != "cuda":
        return "the host's machine-check log (rasdaemon or mcelog); in a CPU emulation, look for a fault injected " \
               "into that rank"
    if key.get("device.hip"):
        return "amd-smi bad-pages, amd-smi metric --ecc, and the RVS or AGFHC tests on that GPU"
    return "dcgmi diag -r 3 on that GPU, and nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT"


def advice(device: Device, group: Group, whole_node: bool) -> str:
    node = node_label(device.identity)
    suspect = (f"every device of {node} in this group dissents: suspect the node (a missed update the fingerprint "
               "does not show, such as firmware or kernel modules; power, cooling) rather than one device. "
               if whole_node else "")
    return (f"{suspect}What to do: drain {node} so that no job lands on it, rerun the node's diagnostics "
            f"({diagnostics(group.key)}), and rerun `{RERUN}` with it before it takes jobs again.")


def _node(device: Device) -> tuple[Any, Any]:
    return device.identity.get("node_rank", 0), device.identity.get("host")


def whole_nodes(group: Group) -> set[tuple[Any, Any]]:
    """Nodes with more than one device in ``group`` where every one of them dissents."""
    devices: dict[tuple[Any, Any], list[Device]] = {}
    for device in group.devices:
        devices.setdefault(_node(device), []).append(device)
    return {node for node, ds in devices.items() if len(ds) > 1 and all(group.outcome_of(d) == DISSENTS for d in ds)}


def dissent_message(vote: Vote, group: Group, device: Device, whole_node: bool = False) -> str:
    majority = group.majority or []
    difference = first_difference(device, majority[0])
    assert difference is not None  # a dissenter differs from the consensus by definition
    return (f"{where(device)} disagrees with the other {len(group.devices) - 1} devices of its model and "
            f"stack ({describe_key(group.key)}): {len(majority)} of {len(group.devices)} hold the consensus; it "
            f"differs first at {difference_text(vote, difference)}.{firmware_note(device, majority)} "
            f"{advice(device, group, whole_node)}")


def firmware_note(device: Device, majority: list[Device]) -> str:
    """Firmware is no part of the group key (group_key.py), so a dissenter's own is worth a word when it is odd."""
    theirs = sorted({d.firmware for d in majority if d.firmware})
    if not device.firmware or not theirs or device.firmware in theirs:
        return ""
    return f" Its firmware ({device.firmware}) is none of the consensus devices' ({'; '.join(theirs[:3])})."


def no_majority_message(vote: Vote, group: Group) -> str:
    lines = [f"no majority among the {len(group.devices)} devices of {describe_key(group.key)}: "
             f"{len(group.results)} different results, none held by more than half, so the vote cannot say which "
             "is wrong:"]
    anchor = group.results[0][0]
    for number, devices in enumerate(group.results, start=1):
        who = "; ".join(where(d) for d in devices)
        difference = first_difference(devices[0], anchor)
        against = "" if difference is None else f"; differs from result 1 first at {difference_text(vote, difference)}"
        lines.append(f"  result {number} ({len(devices)} device{'s' if len(devices) > 1 else ''}): {who}{against}")
    if _split_by_node(group):
        lines.append("  the split follows the nodes: each result comes from its own nodes, so suspect a node (a missed "
                     "update, firmware) rather than a device")
    lines.append("What to do: run on more devices of this model and stack (more nodes under torchrun or srun), or "
                 "compare each device with a stored reference (pytest --gpuregress on each node); then drain the "
                 f"node of the device that loses and rerun its diagnostics ({diagnostics(group.key)}).")
    return "\n".join(lines)


def _split_by_node(group: Group) -> bool:
    """Each of the group's results comes from nodes of its own."""
    nodes = [{_node(d) for d in devices} for devices in group.results]
    return len(nodes) > 1 and all(a.isdisjoint(b) for i, a in enumerate(nodes) for b in nodes[i + 1:])


def failures(vote: Vote) -> list[CheckFinding]:
    """One finding per dissenting device and per group without a majority; [] when every group agrees."""
    out: list[CheckFinding] = []
    for group in vote.groups:
        if group.outcome == DISSENTS:
            suspect_nodes = whole_nodes(group)
            out += [CheckFinding("consensus", dissent_message(vote, group, d, _node(d) in suspect_nodes))
                    for d in group.dissenters]
        elif group.outcome == NO_MAJORITY:
            out.append(CheckFinding("consensus", no_majority_message(vote, group)))
    return out


def stack_splits(vote: Vote) -> list[str]:
    """Groups of the main group's device model on another stack: each is a warning (a node the upgrade missed)."""
    if not vote.groups:
        return []
    main = vote.groups[0]
    out = []
    for group in vote.groups[1:]:
        if group.key.get("device.name") != main.key.get("device.name"):
            continue
        nodes = sorted({node_label(d.identity) for d in group.devices})
        changes = ", ".join(describe_change(*c) for c in key_diff(main.key, group.key))
        out.append(f"{len(group.devices)} device(s) of {main.key.get('device.name')} on {', '.join(nodes)} run another "
                   f"stack than the other {len(main.devices)} of that model ({changes}): a node the upgrade missed, or "
                   "one upgraded early; they are listed apart and were not outvoted")
    return out


# ---- the table and the figures ------------------------------------------------------------------


def group_rows(vote: Vote, group: Group) -> list[tuple[str, str, str, str]]:
    """(device, node, outcome, first difference) for each device of ``group``, by node and rank."""
    out = []
    for device in sorted(group.devices, key=lambda d: (d.identity.get("node_rank", 0), d.rank)):
        against = group.compared_with(device)
        difference = None if against is None else first_difference(device, against)
        text = "-" if difference is None else difference_text(vote, difference)
        if against is not None and difference is not None and group.outcome_of(device) != DISSENTS:
            text = f"vs {device_label(against.identity)}: {text}"  # no consensus: against the largest result
        out.append((device_label(device.identity), node_label(device.identity), group.outcome_of(device), text))
    return out


def rows(vote: Vote) -> list[tuple[str, str, str, str]]:
    return [row for group in vote.groups for row in group_rows(vote, group)]


def table(vote: Vote) -> list[str]:
    header = ("device", "node", "outcome", "first difference")
    widths = [max(len(r[i]) for r in [header, *rows(vote)]) for i in range(3)] + [0]

    def line(cells: tuple[str, ...]) -> str:
        return ("  " + "  ".join(cell.ljust(w) for cell, w in zip(cells, widths))).rstrip()

    lines = []
    for number, group in enumerate(vote.groups, start=1):
        apart = "" if number == 1 else "; listed apart, never outvoted"
        lines.append(f"group {number} ({len(group.devices)} devices, {group.outcome}{apart}): {describe_key(group.key)}")
        lines += [line(header), *(line(row) for row in group_rows(vote, group))]
    return lines


def by_node(vote: Vote) -> list[str]:
    """Nodes with a dissenting device: how many of theirs dissent."""
    counts: dict[str, list[int]] = {}
    for group in vote.groups:
        for device in group.devices:
            tally = counts.setdefault(node_label(device.identity), [0, 0])
            tally[0] += group.outcome_of(device) == DISSENTS
            tally[1] += 1
    return [f"  {node}: {bad} of {total} devices dissent" for node, (bad, total) in sorted(counts.items()) if bad]


def bytes_per_device(device: Device) -> int:
    """What one device sends: 24 bytes per tensor, plus its identity and group key as JSON."""
    who = json.dumps({"identity": device.identity, "key": device.key, "names_sha": device.names_sha})
    return BYTES_PER_TENSOR * len(device.hashes) + len(who.encode())


def figures(vote: Vote, consensus: dict[str, Any], wall_s: float | None) -> str:
    devices = vote.devices
    sent = max(bytes_per_device(d) for d in devices)
    slowest = max((float(d.get("seconds", 0.0)) for d in consensus.get("devices", [])), default=0.0)
    counts = {v: sum(g.outcome_of(d) == v for g in vote.groups for d in g.devices) for v in (AGREES, DISSENTS)}
    return (f"consensus over {len(devices)} devices in {len(vote.groups)} group(s): {counts[AGREES]} agree, "
            f"{counts[DISSENTS]} dissent; {len(vote.names)} tensors a device, {sent} bytes sent a device "
            f"({BYTES_PER_TENSOR} B a tensor, plus its identity); slowest device {slowest:.2f} s"
            + (f", launch {wall_s:.1f} s" if wall_s is not None else ""))


def properties(vote: Vote) -> dict[str, Any]:
    """JUnit figures: the outcome, the dissenters, and the table one row a value."""
    dissenters = [where(d) for g in vote.groups for d in g.dissenters]
    return {"consensus_verdict": {AGREES: "agree", DISSENTS: "dissent"}.get(vote.outcome, vote.outcome),
            "consensus_devices": len(vote.devices),
            "consensus_dissenters": dissenters or None,
            "consensus_table": [" | ".join(row) for row in rows(vote)]}
