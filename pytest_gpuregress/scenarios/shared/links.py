"""The collective sweep, per link: which sender -> receiver pair delivered wrong data, and over what.

Wrong elements counted per sender (where each output element has one known peer) name one link, one sender,
one receiver or the collective itself (docs/consensus.md, "Links"). Used by the sweep's report and the
consensus report. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...findings import CheckFinding
from ...stack.device_identity import describe_link_code, node_label

if TYPE_CHECKING:
    from ...reference.record import RunRecord

ONE_SENDER_OPS = ("all_gather", "all_to_all", "broadcast")  # every output element comes from one known rank


def merge_link_results(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Case id -> the wrong elements and per-link counts summed over the ranks' results."""
    merged: dict[str, dict[str, Any]] = {}
    for results in per_rank:
        for case_id, result in results.items():
            into = merged.setdefault(case_id, {"wrong": 0, "links": {}, "case": result.get("case", {})})
            into["wrong"] += int(result.get("wrong", 0))
            for pair, count in (result.get("links") or {}).items():
                into["links"][pair] = into["links"].get(pair, 0) + int(count)
    return merged


def merge_sweep(records: list[RunRecord], merge_cases: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> RunRecord:
    """Rank 0's record of a sweep launch, its case results merged over the ranks by ``merge_cases``, and every
    rank's identity, to name a wrong link by."""
    merged = records[0]
    merged.results["cases"] = merge_cases([r.results["cases"] for r in records])
    merged.results["identities"] = [r.results.pop("identity", None) for r in records]
    return merged


def pair_counts(results: dict[str, dict[str, Any]]) -> dict[tuple[int, int], int]:
    """(sender, receiver) -> wrong elements, summed over the sweep's cases; a rank's own chunk is left out."""
    counts: dict[tuple[int, int], int] = {}
    for result in results.values():
        for pair, count in (result.get("links") or {}).items():
            sender, receiver = (int(r) for r in pair.split("->"))
            if sender != receiver and count:
                counts[(sender, receiver)] = counts.get((sender, receiver), 0) + int(count)
    return counts


def attribute(counts: dict[tuple[int, int], int], world: int) -> tuple[str, list[tuple[int, int]]]:
    """("clean" | "link" | "sender" | "receiver" | "every" | "several", the wrong pairs)."""
    pairs = sorted(counts)
    if not pairs:
        return "clean", []
    if len(pairs) == 1:
        return "link", pairs
    senders, receivers = {s for s, _ in pairs}, {r for _, r in pairs}
    if len(pairs) == world * (world - 1):
        return "every", pairs
    if len(senders) == 1 and len(pairs) == world - 1:
        return "sender", pairs
    if len(receivers) == 1 and len(pairs) == world - 1:
        return "receiver", pairs
    return "several", pairs


def link_kind(identities: list[dict[str, Any] | None], sender: int, receiver: int, backend: str) -> str:
    """What carries ``sender``'s data to ``receiver``, as far as the ranks' identities tell."""
    a, b = _identity(identities, sender), _identity(identities, receiver)
    if not a or not b:
        return f"{backend}, path unknown"
    same_node = a.get("host") == b.get("host") and a.get("node_rank") == b.get("node_rank")
    if a.get("device", "cpu") == "cpu":
        span = "" if same_node else f" between {node_label(a)} and {node_label(b)}"
        return f"{backend} over loopback{span}" if a.get("host") == b.get("host") else f"{backend} over the network{span}"
    if not same_node:
        return f"{backend} over the network between {node_label(a)} and {node_label(b)}"
    code = (a.get("links") or {}).get(str(b.get("smi_index")))
    return f"{backend} within {node_label(a)}: " + (describe_link_code(code) if code else "NVLink, xGMI or PCIe "
                                                     "(the topology was not read)")


def _identity(identities: list[dict[str, Any] | None], rank: int) -> dict[str, Any] | None:
    return identities[rank] if rank < len(identities) else None


def _rank(identities: list[dict[str, Any] | None], rank: int) -> str:
    identity = _identity(identities, rank)
    return f"rank {rank}" + (f" ({node_label(identity)}, local {identity.get('local_rank')})" if identity else "")


def findings(results: dict[str, dict[str, Any]], identities: list[dict[str, Any] | None], world: int,
             backend: str) -> list[CheckFinding]:
    """The failure message for a sweep's merged case results; [] when every pair exchanged data bit for bit."""
    counts = pair_counts(results)
    verdict, pairs = attribute(counts, world)
    if verdict == "clean":
        return []
    cases = sorted({c for c, r in results.items() if any(r.get("links", {}).get(f"{s}->{d}") for s, d in pairs)})
    wrong = sum(counts.values())
    evidence = f"{wrong} wrong elements in {len(cases)} of {len(results)} cases (e.g. {cases[0]})"
    drain = ("What to do: rerun the sweep ('gpuregress::collectives*') to see whether it repeats; drain the node(s) named and "
             "run their link diagnostics (NVIDIA: dcgmi diag and nvidia-smi nvlink -e; AMD: the RVS xGMI/PEQT tests; "
             "between nodes: the NICs' counters and cables).")
    sender, receiver = pairs[0]
    listed = ", ".join(f"{s} -> {d}: {counts[(s, d)]}" for s, d in pairs)
    said = {
        "link": (f"link {_rank(identities, sender)} -> {_rank(identities, receiver)} "
                 f"({link_kind(identities, sender, receiver, backend)}) delivers wrong data: {evidence}; every other "
                 f"pair of the {world} ranks is clean. {drain}"),
        "sender": (f"{_rank(identities, sender)}'s data arrives wrong at every peer: {evidence}; the sender's "
                   f"device or send path, not one link. {drain}"),
        "receiver": (f"{_rank(identities, receiver)} receives every peer's data wrong: {evidence}; its receive "
                     f"path or memory, not one link. {drain}"),
        "every": (f"every pair of the {world} ranks delivers wrong data: {evidence}; the collective itself "
                  "(its library, protocol or algorithm), not one link: see the sweep's per-case failures "
                  "('gpuregress::collectives*')"),
        "several": f"wrong data on {len(pairs)} links (sender -> receiver: wrong elements): {listed}; {evidence}. {drain}",
    }[verdict]
    return [CheckFinding("links", said, {"pattern": verdict})]


def summary(results: dict[str, dict[str, Any]], identities: list[dict[str, Any] | None], world: int,
            backend: str) -> str:
    """One line for a report: the wrong link named, or every pair clean."""
    found = findings(results, identities, world, backend)
    if found:
        return "links: " + found[0].message.split(" What to do")[0]
    moving = sum(1 for r in results.values()  # an op the backend lacks moved nothing: it vouches for no link
                 if (r.get("case") or {}).get("op") in ONE_SENDER_OPS and not r.get("unsupported"))
    if not moving:
        return "links: no case that names its sender ran, so no link was checked"
    kind = link_kind(identities, 1, 0, backend) if world > 1 else backend
    return (f"links: all {world * (world - 1)} sender -> receiver pairs of {world} ranks delivered every element "
            f"bit for bit in the {moving} cases that name their sender ({kind}, for ranks 1 -> 0)")
