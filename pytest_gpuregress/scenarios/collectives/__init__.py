"""Scenario ``collectives``: every op, variant, dtype and size against its closed-form result, bit for bit.

Session side; ``plan.py`` plans and judges, ``rank.py`` runs. One launch per protocol group (an
``NCCL_PROTO``/``NCCL_ALGO`` setting) serves all its selected cases: a launch per case would take hours.
"""

from __future__ import annotations

from itertools import product
from typing import Any

from ... import activities as act
from ...fault_points import emulated_ops
from ...findings import CheckFinding, Problem
from ...option_spec import SCENARIO_OPTIONS
from ...reference.names import safe_component
from ...reference.record import RunRecord
from ..base import Case, CheckScenario, Launch, Setup
from ..shared import links
from . import plan

SIZE_BANDS = [(1 << 10, "<=1KiB"), (64 << 10, "<=64KiB"), (512 << 10, "<=512KiB"), (4 << 20, "<=4MiB"),
              (64 << 20, "<=64MiB"), (1 << 62, ">64MiB")]
DEFAULT_MAX_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}


def protocol_groups(protos: list[str], algos: list[str], backend: str) -> dict[str, dict[str, str]]:
    """Label -> environment for each group of ranks. Only NCCL/RCCL have protocols."""
    if backend != "nccl" or not (protos or algos):
        return {"default": {}}
    groups: dict[str, dict[str, str]] = {}
    for proto, algo in product(protos or [""], algos or [""]):
        env = {k: v for k, v in (("NCCL_PROTO", proto), ("NCCL_ALGO", algo)) if v}
        groups["+".join(env.values())] = env
    return groups


# RCCL enables LL128 only on the GPUs it validated it on: on MI300 (gfx942) NCCL_PROTO=LL128 silently runs Simple
# unless RCCL_LL128_FORCE_ENABLE=1 (RCCL's docs and release notes). Neither library reports which protocol a call
# used, so a pinned group's label is what was asked for; where that is known not to be what ran, the summary says so.
RCCL_LL128_FORCE = "RCCL_LL128_FORCE_ENABLE"
RCCL_LL128_VALIDATED = ("gfx90a", "gfx950")  # RCCL enables LL128 by default there; gfx942 needs the switch


def protocol_ran(label: str, record: RunRecord) -> str:
    """What can be said of the protocol a group of the sweep ran, from its record's fingerprint."""
    comm = record.fingerprint.get("comm", {})
    env = comm.get("env") or {}
    proto = env.get("NCCL_PROTO") or ("" if label == "default" else label.split("+")[0])
    if not proto:
        return "the library's own choice by size and topology (not reported back)"
    arch = str(record.fingerprint.get("device", {}).get("arch") or "")
    if comm.get("rccl") and _ll128_needs_force(proto, env, arch):
        return (f"Simple, not {proto}: RCCL on {arch or 'this GPU'} runs LL128 only with {RCCL_LL128_FORCE}=1, so "
                f"these are Simple's results; set it to test LL128")
    return f"{proto} as pinned by NCCL_PROTO (the library does not report it back; NCCL_DEBUG=INFO with " \
           f"NCCL_DEBUG_SUBSYS=TUNING logs each choice)"


def _ll128_needs_force(proto: str, env: dict[str, str], arch: str) -> bool:
    """RCCL was asked for LL128 on a GPU where it runs Simple instead unless forced."""
    return "LL128" in proto.split(",") and env.get(RCCL_LL128_FORCE) != "1" and not arch.startswith(RCCL_LL128_VALIDATED)


def exercised(op: str, dtype: str = "fp32") -> act.Exercises:
    """A sweep case runs its one op; a bf16 rounding fault acts in the SUM reductions (faults/collective.py); a bf16
    case makes its inputs and expected values by a cast to bf16 (rank.py checks it)."""
    reduces = (act.bf16_reduction(op),) if op in ("all_reduce", "reduce_scatter") else ()
    casts = (act.BF16_CAST,) if dtype.startswith("bf16") else ()
    return act.exercises(act.collective(op), *reduces, *casts, summary="the sweep runs collectives only: no model, no step")

class CollectivesScenario(CheckScenario):
    name = "collectives"
    rank_entry = "pytest_gpuregress.scenarios.collectives.rank:run"
    options = SCENARIO_OPTIONS["collectives"]  # declared with the plugin's: pytest reads them without importing this
    evidence_for = "collective"
    evidence_name = "collective sweep"

    def groups(self, setup: Setup) -> dict[str, dict[str, str]]:
        return protocol_groups(setup.option("nccl-protos") or [], setup.option("nccl-algos") or [], setup.backend)

    def pinning_ignored(self, setup: Setup) -> bool:
        """Protocol options were given but this backend has no protocols to pin."""
        return bool(setup.option("nccl-protos") or setup.option("nccl-algos")) and setup.backend != "nccl"

    def planned(self, setup: Setup) -> list[plan.Case]:
        max_bytes = setup.option("collectives-max-bytes") or DEFAULT_MAX_BYTES.get(setup.device_kind, 4 << 20)
        return plan.plan(setup.backend, setup.world_size, max_bytes, protocols=list(self.groups(setup)),
                         emulated=emulated_ops(setup.faults))

    def cases(self, setup: Setup) -> list[Case]:
        # One rank moves no data: every case needs a peer to test anything.
        return [Case(c.id, launch=c.protocol, data=c.to_json(), min_ranks=2, exercises=exercised(c.op, c.dtype),
                     family=self.name) for c in self.planned(setup)]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        groups = self.groups(setup)
        repeats = setup.option("collectives-repeats")
        return [
            Launch(safe_component(protocol, "NCCL protocol group (from --gpuregress-nccl-protos and --gpuregress-nccl-algos)"),
                   {"cases": [c.data for c in cases if c.launch == protocol], "repeats": repeats}, env)
            for protocol, env in groups.items()
            if any(c.launch == protocol for c in cases)
        ]

    def merge(self, records: list[RunRecord]) -> RunRecord:
        return links.merge_sweep(records, plan.merge_rank_results)

    def unsupported(self, case: Case, record: RunRecord, setup: Setup) -> str | None:
        result = record.results["cases"][case.id]
        if not plan.lacks_only(result):
            return None
        return (f"{setup.backend} on torch {_torch_of(record)} lacks "
                f"{plan.Case(**case.data).describe(setup.world_size)}: {result['unsupported']}. Nothing was computed, "
                f"so no number is wrong; the sweep plans it because {_planned_on(setup)}")

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        result = record.results["cases"][case.id]
        if result.get("cast_error"):  # the case's own inputs are wrong, before any collective ran
            return [CheckFinding("collective-inputs",
                                 f"{plan.Case(**case.data).describe(setup.world_size)}: {result['cast_error']}")]
        problem = plan.problem(plan.Case(**case.data), result, setup.world_size)
        return [CheckFinding("collective-case", problem)] if problem else []

    def properties(self, case: Case, record: RunRecord, setup: Setup) -> dict[str, Any]:
        return {"wrong_elements": int(record.results["cases"][case.id]["wrong"]),
                "seconds": record.timings.get("launch_wall_s")}

    def header(self, setup: Setup) -> list[str]:
        if not self.pinning_ignored(setup):
            return []
        return [f"gpuregress: NCCL protocol/algorithm pinning does not apply to {setup.backend}; "
                "the collective sweep runs once with the backend's default"]

    def artifacts(self, key: str, record: RunRecord, setup: Setup) -> dict[str, str]:
        cases, results = _cases_and_results(record)
        table = plan.bandwidth_table(cases, results, setup.world_size, protocol=key)
        return {"bandwidth.txt": "\n".join(table) + "\n"}

    def summary(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        ran = {protocol: record for protocol, record in records.items() if record is not None}
        lines = [line for protocol, record in ran.items() for line in _launch_lines(protocol, record, setup)]
        if self.pinning_ignored(setup):
            lines.append(f"NCCL protocol/algorithm pinning does not apply to {setup.backend}: ran the default sweep once")
        lines += self.protocol_table(records, setup)
        dtype = "bf16" if setup.device_kind == "cuda" else "fp32"
        for protocol, record in ran.items():
            cases, results = _cases_and_results(record)
            rows = plan.bandwidth_table(cases, results, setup.world_size, dtype, protocol, op="all_reduce",
                                        reduce_op="sum")
            if len(rows) > 1:
                lines.append(f"all_reduce SUM {dtype} bandwidth, protocol {protocol} "
                             "(full table: bandwidth.txt beside the saved record):")
                lines += rows
        return lines

    def protocol_table(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        """Which protocol fails at which size band: counts of failing cases; 'did not run' for a failed launch."""
        rows = [f"  {protocol:<14} " + ("did not run" if record is None else " ".join(
                    f"{count:>9}" for count in _failing_by_band(record, setup.world_size).values()))
                for protocol, record in records.items()]
        return ["failing cases by protocol and size band:",
                f"  {'protocol':<14} " + " ".join(f"{lbl:>9}" for _, lbl in SIZE_BANDS), *rows]


def _launch_lines(protocol: str, record: RunRecord, setup: Setup) -> list[str]:
    """One protocol group's launch: its cases, time and protocol, its links, the ops its backend lacks."""
    cases, _ = _cases_and_results(record)
    ran = f"; ran {protocol_ran(protocol, record)}" if setup.backend == "nccl" else ""
    return [f"protocol {protocol}: {len(cases)} cases on {setup.world_size} {setup.backend} ranks in "
            f"{record.timings.get('launch_wall_s', 0.0):.1f}s{ran}",
            "  " + links.summary(record.results["cases"], record.results.get("identities", []),
                                 setup.world_size, setup.backend),
            *_lacking(record, setup)]


def _failing_by_band(record: RunRecord, world: int) -> dict[str, int]:
    """Size band label -> how many of the launch's cases fail in it."""
    counts = dict.fromkeys((label for _, label in SIZE_BANDS), 0)
    cases, results = _cases_and_results(record)
    for case in cases:
        if plan.problem(case, results[case.id], world):
            counts[next(lbl for limit, lbl in SIZE_BANDS if case.nbytes(world) <= limit)] += 1
    return counts


def _torch_of(record: RunRecord) -> str:
    return str(record.fingerprint.get("versions", {}).get("torch", "?"))


def _lacking(record: RunRecord, setup: Setup) -> list[str]:
    """The ops this stack's backend lacks, with the cases skipped for each: a capability, apart from failures."""
    skipped: dict[str, list[str]] = {}
    for result in record.results["cases"].values():
        if plan.lacks_only(result):
            skipped.setdefault(plan.Case(**result["case"]).op_label, []).append(result["unsupported"].split(": ", 1)[-1])
    return [f"  not supported on this stack ({setup.backend}, torch {_torch_of(record)}): {op}, {len(said)} cases "
            f"skipped ({said[0]}); {_planned_on(setup)}" for op, said in skipped.items()]


def _planned_on(setup: Setup) -> str:
    return plan.PLANNED_ON.get(setup.backend, "the backend documents it")


def _cases_and_results(record: RunRecord) -> tuple[list[plan.Case], dict[str, Any]]:
    """The cases a launch ran, in plan order (a stored record keeps them sorted by id), and their results."""
    results = record.results["cases"]
    kinds = {kind: i for i, kind in enumerate(plan.KINDS)}
    cases = [plan.Case(**r["case"]) for r in results.values()]
    cases.sort(key=lambda c: (kinds[(c.op, c.variant, c.reduce_op, c.in_place)], c.dtype, c.n))
    return cases, results


SCENARIO = CollectivesScenario()
