"""Scenario ``consensus``: find the one bad device or node, by a vote across devices (``--gpuregress-consensus``).

Session side, torch-free. ``devices``: every rank runs the same single-device workload and its digests are voted
on bit for bit within its group of device model and stack; a dissenter is named by node, index, bus id and
UUID. ``links``: the collective sweep per pair of ranks names a corrupted link. docs/consensus.md.
"""

from __future__ import annotations

from typing import Any

from ... import activities as act
from ...findings import Problem
from ...option_spec import SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ...warn import warn_at_test
from ..base import Case, CheckScenario, Launch, Setup
from ..shared import links
from . import report
from .digest import HASH_ARRAY, STATS_ARRAY, hex_hashes
from .vote import Device, Vote, vote

COLLECTIVES_ENTRY = "pytest_gpuregress.scenarios.collectives.rank:run"
WORKLOAD = {"seed": 0, "steps": 6, "width": 32, "hidden": 64, "classes": 10, "batch": 16, "lr": 1e-2,
            "parts": ["train", "gemm", "cast"]}
LINK_REPEATS = 3  # a stale-buffer fault (collective:mode=stale_chunk) shows from the second call of a shape on


# The devices' workload: an MLP (nn.Linear) and a matmul battery, each device alone: no collective, no step hooks.
DEVICES_EXERCISE = act.exercises(act.LINEAR_ALGEBRA, summary="one process per device, each alone: an MLP and a "
                                 "matmul battery, no collective, no scenario step hooks")
# The link sweep moves data only, with the ops whose every output element comes from one known rank (collectives/plan.py).
LINKS_EXERCISE = act.exercises(*(act.collective(op) for op in ("all_gather", "broadcast", "all_to_all")),
                               summary="a sweep of data-moving collectives (all-gather, broadcast, all-to-all): no model")

class ConsensusScenario(CheckScenario):
    """Every device runs the same single-device workload; the odd one out is named."""

    name = "consensus"
    rank_entry = "pytest_gpuregress.scenarios.consensus.rank:run"
    options = SCENARIO_OPTIONS["consensus"]  # declared beside the plugin's: pytest reads them without importing this

    def cases(self, setup: Setup) -> list[Case]:
        if not setup.option("consensus"):
            return []
        # One device has nobody to vote with, one rank no link: below 2 ranks both are skipped, saying so.
        return [Case("devices", launch="devices", min_ranks=2, exercises=DEVICES_EXERCISE),
                Case("links", launch="links", min_ranks=2, exercises=LINKS_EXERCISE)]

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return dict(WORKLOAD)  # its own few steps: --gpuregress-steps sizes the training scenarios

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        wanted = {case.launch for case in cases}
        out = []
        if "devices" in wanted:
            out.append(Launch("devices", self.default_config(setup)))
        if "links" in wanted:  # the sweep's own rank code plans its small per-link sweep (collectives/plan.py)
            out.append(Launch("links", {"link_sweep": True, "repeats": LINK_REPEATS}, entry=COLLECTIVES_ENTRY))
        return out

    def merge(self, records: list[RunRecord]) -> RunRecord:
        if records[0].scenario == "collectives":  # the links launch runs the sweep's rank code
            return links.merge_sweep(records, links.merge_link_results)
        return merge_devices(records)

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        if case.id == "links":
            return links.findings(*link_inputs(record), setup.backend)
        vote = vote_of(record)
        for split in report.stack_splits(vote):
            warn_at_test(report.ConsensusStackSplit(split))
        return report.failures(vote)

    def properties(self, case: Case, record: RunRecord, setup: Setup) -> dict[str, Any]:
        seconds = {"seconds": record.timings.get("launch_wall_s")}
        if case.id == "links":
            wrong = sum(links.pair_counts(record.results["cases"]).values())
            return {**seconds, "wrong_elements": wrong, "consensus_links": links.summary(*link_inputs(record),
                                                                                          setup.backend)}
        return {**seconds, **report.properties(vote_of(record))}

    def summary(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        lines: list[str] = []
        devices = records.get("devices")
        if devices is not None:
            vote = vote_of(devices)
            lines.append(report.figures(vote, devices.results["consensus"], devices.timings.get("launch_wall_s")))
            lines += report.table(vote)
            dissent = report.by_node(vote)
            lines += ["by node:", *dissent] if dissent else []
            lines += [f"stack split: {split}" for split in report.stack_splits(vote)]
        if records.get("links") is not None:
            lines.append(links.summary(*link_inputs(records["links"]), setup.backend))
        return lines

    def artifacts(self, key: str, record: RunRecord, setup: Setup) -> dict[str, str]:
        if key != "devices":
            return {}
        return {"consensus.txt": "\n".join(report.table(vote_of(record))) + "\n"}


def merge_devices(records: list[RunRecord]) -> RunRecord:
    """Rank 0's record, carrying every device's identity, key and digests (as JSON: hashes in hex)."""
    merged = records[0]
    first = merged.results["consensus"]
    devices = []
    for rank, record in enumerate(records):
        own = {k: v for k, v in record.results["consensus"].items() if k not in ("names", "kinds")}
        stats = record.arrays[STATS_ARRAY]
        own.update(rank=rank, hashes=hex_hashes(record.arrays[HASH_ARRAY]), sums=stats[:, 0].tolist(),
                   magnitudes=stats[:, 1].tolist())
        devices.append(own)
    merged.results["consensus"] = {"names": first.get("names", []), "kinds": first.get("kinds", []),
                                   "devices": devices}
    merged.arrays = {}  # every device's digests are in the JSON now
    return merged


def link_inputs(record: RunRecord) -> tuple[dict[str, Any], list[Any], int]:
    return record.results["cases"], record.results.get("identities", []), record.world_size


def vote_of(record: RunRecord) -> Vote:
    consensus = record.results["consensus"]
    return vote([Device.from_json(d) for d in consensus["devices"]], consensus.get("names", []),
                consensus.get("kinds", []))


SCENARIO = ConsensusScenario()
