"""Run the collective sweep once per protocol group and serve per-case verdicts to the tests.

Each case is its own pytest item, but launching ranks per case would take hours; so the first
item to run launches one group of ranks per protocol (or algorithm) setting with every selected
case of that group, and later items read the cached results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import collectives as plan
from .errors import RankFailure

if TYPE_CHECKING:
    from .session import GpuRegressSession

SIZE_BANDS = [(1 << 10, "<=1KiB"), (64 << 10, "<=64KiB"), (512 << 10, "<=512KiB"), (4 << 20, "<=4MiB"),
              (64 << 20, "<=64MiB"), (1 << 62, ">64MiB")]


def parse_bytes(text: str | int) -> int:
    """'4MiB', '512K', '1G' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().replace("ib", "").replace("b", "")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def protocol_groups(protos: list[str], algos: list[str], backend: str) -> dict[str, dict[str, str]]:
    """Label -> environment for each group of ranks. Only NCCL/RCCL have protocols."""
    if backend != "nccl" or not (protos or algos):
        return {"default": {}}
    groups: dict[str, dict[str, str]] = {}
    for proto in protos or [""]:
        for algo in algos or [""]:
            label = "+".join(p for p in (proto, algo) if p)
            env = {k: v for k, v in (("NCCL_PROTO", proto), ("NCCL_ALGO", algo)) if v}
            groups[label] = env
    return groups


@dataclass
class CollectiveSweep:
    session: GpuRegressSession
    groups: dict[str, dict[str, str]]
    selected: list[plan.Case] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # protocol -> launch failure
    timings: dict[str, float] = field(default_factory=dict)
    saved: dict[str, Path] = field(default_factory=dict)

    def all_cases(self) -> list[plan.Case]:
        opts = self.session.options
        emulated = ("premul_sum",) if any(f.startswith("emulate_premul_sum") for f in opts.inject) else ()
        return plan.plan(self.session.platform.backend, self.session.platform.world_size,
                         parse_bytes(opts.collectives_max_bytes or self._default_max()),
                         protocols=list(self.groups), emulated=emulated)

    def _default_max(self) -> int:
        return self.session.resolve("collectives").default_config(self.session.platform.device_kind, None)["max_bytes"]

    def result(self, case_id: str) -> tuple[plan.Case, dict[str, Any]]:
        """The merged result for ``case_id``, running its protocol group's sweep on first use."""
        case = next(c for c in self.selected if c.id == case_id)
        if case.protocol in self.failures:
            raise RankFailure(self.failures[case.protocol])
        if case_id not in self.results:
            self._run_group(case.protocol)
            if case.protocol in self.failures:
                raise RankFailure(self.failures[case.protocol])
        return case, self.results[case_id]

    def _run_group(self, protocol: str) -> None:
        cases = [c for c in self.selected if c.protocol == protocol]
        config = {"cases": [c.to_json() for c in cases], "repeats": self.session.options.collectives_repeats}
        try:
            record = self.session.run("collectives", config=config, env=self.groups.get(protocol, {}))
        except RankFailure as exc:
            self.failures[protocol] = f"the collective sweep for protocol {protocol!r} did not finish:\n{exc}"
            return
        self.results.update(record.results["cases"])
        self.timings[protocol] = record.timings.get("launch_wall_s", 0.0)
        if self.session.output_dir is not None:
            target = self.session.output_dir / "collectives" / record.platform_key / protocol.replace("+", "_")
            record.save(target)
            table = plan.bandwidth_table(cases, record.results["cases"], self.session.platform.world_size,
                                         protocol=protocol)
            (target / "bandwidth.txt").write_text("\n".join(table) + "\n")
            self.saved[protocol] = target

    # --- tables for the terminal summary -------------------------------------------------------

    def protocol_table(self) -> list[str]:
        """Which protocol fails at which size band: counts of failing cases."""
        world = self.session.platform.world_size
        rows = []
        for protocol in self.groups:
            counts = dict.fromkeys((label for _, label in SIZE_BANDS), 0)
            ran = False
            for case in (c for c in self.selected if c.protocol == protocol):
                res = self.results.get(case.id)
                if res is None:
                    continue
                ran = True
                if plan.verdict(case, res, world):
                    label = next(lbl for limit, lbl in SIZE_BANDS if case.nbytes(world) <= limit)
                    counts[label] += 1
            if ran or protocol in self.failures:
                cells = ["did not run"] if protocol in self.failures else [f"{counts[lbl]:>9}" for _, lbl in SIZE_BANDS]
                rows.append(f"  {protocol:<14} " + " ".join(cells))
        if not rows:
            return []
        return ["failing cases by protocol and size band:",
                f"  {'protocol':<14} " + " ".join(f"{lbl:>9}" for _, lbl in SIZE_BANDS), *rows]

    def bandwidth_table(self, dtype: str | None = None, protocol: str = "default", **narrow: str) -> list[str]:
        return plan.bandwidth_table(self.selected, self.results, self.session.platform.world_size, dtype, protocol,
                                    **narrow)
