"""Which cases each injected fault can act in, from ``Case.exercises`` and ``ACTS_ON`` (activities.py).

A case no injected fault reaches is skipped as not applicable rather than run clean or failed as unfired;
a case that declares nothing is reached by every fault. ``table_lines()`` is docs/faults.md's table
(tests/faults/test_fault_reach.py keeps it equal). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from .. import activities as act
from ..kinds import DeviceKind
from ..option_spec import BUILTIN_SCENARIO_OPTIONS
from ..scenarios import Case, Setup, registry, test_id
from . import ACTS_ON, KINDS, FaultSpec, acted_on, activities_of, parse


def reaches(spec: FaultSpec, case: Case) -> bool:
    """Whether ``spec`` acts on anything ``case`` runs; a case that declares nothing: always."""
    return case.exercises is None or act.meets(acted_on(spec), case.exercises.does)


def reaching(texts: Iterable[str], cases: Sequence[Case]) -> list[str]:
    """The specs of ``texts`` that reach at least one of ``cases`` (the cases a launch serves)."""
    return [t for t in texts if any(reaches(parse(t), case) for case in cases)]


def installed_code(texts: Iterable[str]) -> list[str]:
    """The specs of ``texts`` whose kind is code installed on the machine (a library release): they run in every
    launch, the float64 oracle's too, where a fault of the stack under test never does."""
    return [t for t in texts if KINDS[parse(t).kind].installed_code]


def unreached_reason(texts: Iterable[str], case: Case, case_id: str,
                     others: Callable[[], Iterable[tuple[str, Case]]] = tuple) -> str | None:
    """Why ``case`` (test id ``case_id``) is skipped when faults are injected and none reaches it; None when one
    does (or none is given). ``others()``: (test id, case) of this configuration, to say where the faults act."""
    specs = [parse(t) for t in texts]
    if not specs or any(reaches(spec, case) for spec in specs):
        return None
    why = _why_not(specs, case.exercises or act.Exercises(frozenset()))
    acts = _acting_in(specs, others())
    return (f"--gpuregress-inject {'; '.join(spec.text for spec in specs)}: no injected fault acts in {case_id}"
            + (f" ({why})" if why else "") + (f"; it acts in {', '.join(acts)}" if acts else "")
            + "; docs/faults.md lists where each fault acts")


def _why_not(specs: list[FaultSpec], exercised: act.Exercises) -> str:
    """What each of ``specs`` acts on that a case exercising ``exercised`` lacks, each reason once."""
    return "; ".join(dict.fromkeys(filter(None, (act.reason_absent(acted_on(spec), exercised) for spec in specs))))


def _acting_in(specs: list[FaultSpec], cases: Iterable[tuple[str, Case]]) -> list[str]:
    """The families (or test ids) of the declared ``cases`` that one of ``specs`` reaches."""
    return sorted({case.family or case_id for case_id, case in cases
                   if case.exercises is not None and any(reaches(spec, case) for spec in specs)})


def catalogue(device_kind: DeviceKind = "cpu") -> dict[str, Case]:
    """The declared cases of a 2-rank run on ``device_kind`` ("cpu" or "cuda"), consensus included, by test id."""
    options = {spec.dest: spec.default for spec in BUILTIN_SCENARIO_OPTIONS}
    options["gpuregress_consensus"] = True
    setup = Setup(device_kind=device_kind, backend="gloo" if device_kind == "cpu" else "nccl", world_size=2,
                  options=options)
    return {test_id(sc.name, case.id): case for sc in registry().values() for case in sc.cases(setup)
            if case.exercises is not None}


def families(cases: dict[str, Case]) -> dict[str, list[Case]]:
    """The table's columns: each family of cases (the sweep's, formats'), or a case of its own."""
    out: dict[str, list[Case]] = {}
    for case_id, case in cases.items():
        out.setdefault(case.family or case_id, []).append(case)
    return out


def table_lines() -> list[str]:
    """The fault x case table of docs/faults.md, in markdown: where each fault kind (and mode with its own entry)
    acts on a CPU, and where only on GPUs."""
    cpu, gpu = families(catalogue("cpu")), families(catalogue("cuda"))
    rows = ["| fault | " + " | ".join(f"`{c}`" for c in cpu) + " |", "|---" * (len(cpu) + 1) + "|"]
    for key in ACTS_ON:
        acted = activities_of(key)
        rows.append(f"| `{key}` | " + " | ".join(_cell(acted, cpu[c], gpu.get(c, [])) for c in cpu) + " |")
    return rows


def _cell(acted: frozenset[str], cpu: list[Case], gpu: list[Case]) -> str:
    reached = sum(act.meets(acted, case.exercises.does) for case in cpu if case.exercises is not None)
    if reached == len(cpu):
        return "acts"
    if reached:
        return f"acts ({reached} of {len(cpu)} cases)"
    on_gpu = any(act.meets(acted, case.exercises.does) for case in gpu if case.exercises is not None)
    return "GPU only" if on_gpu else "n/a"
