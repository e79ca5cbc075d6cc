"""Which cases exist, which survived -k and -m, and which this run's ranks can run."""

from __future__ import annotations

from ..errors import NotApplicable
from ..faults import reach
from ..scenarios import Case, Launch, Scenario, Setup, registry
from ..scenarios import test_id as case_test_id
from ..stack.platforms import SINGLE_RANK_GAPS, Platform, rank_origin, too_few_ranks
from .collection import builtin_node_id


def test_id(scenario: Scenario, case: Case) -> str:
    """The case's pytest id: the scenario's name, then the case's own id where it has one."""
    return case_test_id(scenario.name, case.id)


class Selection:
    def __init__(self, setup: Setup, platform: Platform, world_size_asked: int | None, inject: list[str]) -> None:
        self.setup = setup
        self.platform = platform
        self.world_size_asked = world_size_asked  # --gpuregress-world-size (None: the platform's)
        self.inject = inject  # --gpuregress-inject
        self.selected: dict[str, list[Case]] = {}  # scenario -> cases left after -k and -m

    def all_cases(self) -> list[tuple[Scenario, Case]]:
        return [(sc, case) for sc in registry().values() for case in sc.cases(self.setup)]

    def select(self, chosen: set[tuple[str, str]]) -> None:
        """Keep the (scenario, case id) pairs that survived -k and -m, so launches carry only those."""
        self.selected = {}
        for sc, case in self.all_cases():
            if (sc.name, case.id) in chosen and self.rank_shortfall(case) is None:  # skipped ones launch nothing
                self.selected.setdefault(sc.name, []).append(case)

    def rank_shortfall(self, case: Case) -> str | None:
        """Why ``case`` cannot run with this run's ranks (the skip reason), or None when it can."""
        return too_few_ranks(case.min_ranks, self.platform, self.world_size_asked)

    def rank_header(self) -> list[str]:
        """At one rank, the header says what it cannot exercise, and how many cases are skipped for it."""
        if self.platform.world_size > 1:
            return []
        skipped = sum(self.rank_shortfall(case) is not None for _, case in self.all_cases())
        return [f"gpuregress single rank ({rank_origin(self.platform, self.world_size_asked)}): {SINGLE_RANK_GAPS}; "
                f"{skipped} cases that need 2 or more ranks are skipped, and faults that need peers are refused"]

    def runnable_case(self, scenario: str, case_id: str) -> tuple[Scenario, Case]:
        """The case to run, or NotApplicable (a skip) when this run's ranks or faults cannot test it."""
        sc = registry()[scenario]
        case = self._case(sc, case_id)
        shortfall = self.rank_shortfall(case)
        if shortfall:  # a direct call; the built-in suite already skips such cases
            raise NotApplicable(shortfall)
        if self.inject:  # without faults every case runs: no need to list them
            unreached = reach.unreached_reason(self.inject, case, test_id(sc, case),
                                               lambda: [(test_id(s, c), c) for s, c in self.all_cases()])
            if unreached:  # it would run clean, proving nothing about the faults asked for
                raise NotApplicable(unreached)
        return sc, case

    def _case(self, sc: Scenario, case_id: str) -> Case:
        """The case ``case_id`` of ``sc``: a selected one, else (skipped for want of ranks, so not selected) any."""
        return next((c for c in self.selected.get(sc.name, []) if c.id == case_id), None) \
            or next(c for c in sc.cases(self.setup) if c.id == case_id)

    def launch_of(self, sc: Scenario, case: Case) -> Launch:
        """The launch that carries ``case``, planned with the cases selected beside it."""
        cases = self.selected.get(sc.name) or [case]
        return next(la for la in sc.launches(cases, self.setup) if la.key == case.launch)

    def served_cases(self, sc: Scenario, launch_key: str) -> list[Case]:
        """The selected cases ``launch_key`` carries; where none is (a launch another scenario's experiment runs,
        triage's of fsdp), every case of the scenario it could carry."""
        served = [c for c in self.selected.get(sc.name, []) if c.launch == launch_key]
        return served or sc.cases(self.setup)

    def node_ids_for(self, reference: str) -> list[str]:
        """The node ids that select the built-in cases a recording of ``reference`` runs (``_recorded_with``):
        ``gpuregress::fsdp*`` where that pattern selects exactly those, else their ids: a printed record command
        never re-records another reference (a model's, say)."""
        cases = [(sc.name, test_id(sc, case), sc.reference_name(case)) for sc, case in self.all_cases()]
        ids = _recorded_with(reference, cases)
        if len(ids) > 1 and [case_id for _, case_id, _ in cases if case_id.startswith(reference)] == ids:
            return [builtin_node_id(f"{reference}*")]
        return [builtin_node_id(i) for i in ids]

    def reference_names(self) -> set[str]:
        """Every reference some case of this configuration reads, selected or not."""
        return {name for sc, case in self.all_cases() if (name := sc.reference_name(case)) is not None}



def _recorded_with(reference: str, cases: list[tuple[str, str, str | None]]) -> list[str]:
    """Of ``cases`` (scenario, test id, the reference it reads), those that read ``reference``, and the cases of
    their scenarios that read none (the formats reference stores what its decode and encode cases found)."""
    scenarios = {name for name, _, read in cases if read == reference}
    return [case_id for name, case_id, read in cases if read == reference or (read is None and name in scenarios)]
