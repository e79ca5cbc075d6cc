"""Triage: name the component behind a difference with experiments, each of which clears or convicts one.

equivalence (N ranks against one on the same global batch: a difference convicts a collective), the float64
oracle (one process, no collective: a difference convicts a kernel), and with --gpuregress-triage the switch
flips (flips.py). The first two need no reference; docs/triage.md describes all three. torch-free:
experiments run through a launcher the session passes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..comparison.bounds import step0_bound
from ..comparison.compare import gradients_moved_first
from ..comparison.envelope import rel, step0_limit
from ..components import Component
from ..evidence import clipping, collective_invariants, step0
from ..evidence.op_trace import TRACE_CONFIG
from ..reference import by_name
from ..reference.record import RunRecord
from ..scenarios.base import Launch, Runner
from ..training.step import EMULATE_WORLD
from .decision import CLIP, INVARIANTS, RULES, Evidence, Rule, Verdict, decide, first_step
from .naming import op_component

if TYPE_CHECKING:
    from ..comparison.compare import Comparison
    from ..scenarios.base import Scenario, Setup, TriageSupport

LATE_WINDOW = "late window"  # the experiment of late_window.py
TRIAGE_STEPS = 3  # equivalence compares step 0's gradients and the losses of the first steps
ORACLE_ENTRY = "pytest_gpuregress.training.oracle:run"


Status = Literal["clean", "differs", "vanished", "shrank", "stayed", "not applicable", "failed to run", "reproduced",
                 "reproduced later", "did not reproduce", "broke", "held", "inconsistent", "named", "no revert restores"]


@dataclass
class Experiment:
    name: str
    status: Status
    detail: str
    component: Component | None = None  # what this result convicts, when it convicts one
    lines: list[str] = field(default_factory=list)  # per-parameter detail

    @property
    def convicts(self) -> bool:
        return self.status in ("differs", "vanished", "reproduced", "broke", "inconsistent", "named")


def own_evidence(run: RunRecord) -> list[Experiment]:
    """What the failing run says of itself: its collectives against their own invariants across the ranks (broke,
    or held where the gradients' own were checked), and its clip against its own norm where it is inconsistent."""
    out = []
    broken = collective_invariants.problems(run.results)
    if broken:
        first, _, rest = broken[0].message.partition("\n")
        out.append(Experiment(INVARIANTS, "broke", first, component="collective",
                        lines=[line.strip() for line in rest.splitlines()]))
    elif (kept := collective_invariants.held(run.results)) is not None:  # clears the gradients' collectives
        out.append(Experiment(INVARIANTS, "held", kept))
    clip = clipping.problems(run)
    if clip:
        out.append(Experiment(CLIP, "inconsistent", clip[0].message, component="optimizer"))
    return out


def launches(sc: Scenario, setup: Setup, model: str | None = None) -> dict[str, Launch]:
    """The three short launches of the cheap evidence: N ranks, one rank, and the float64 oracle;
    of the scenario's own model, or of a user's (``model``, --gpuregress-model)."""
    # No step-0 op trace: these runs are compared with each other, never op by op with a reference. Every one
    # starts cold: the N ranks that just trained are warmed up, the one rank is not, and a bug that needs a
    # warmed-up process would read as "N ranks differ from one" (a collective) if the N-rank run reused them.
    config = {**sc.model_config(setup, model), "steps": TRIAGE_STEPS, TRACE_CONFIG: False}
    suffix = model_suffix(model)
    return {
        "n": Launch(f"triage-n{suffix}", config, cold=True),
        # Each of the N ranks' micro-batches in turn, with their shapes: only the communication differs from "n".
        "one": Launch(f"triage-1{suffix}", {**config, EMULATE_WORLD: setup.world_size}, world_size=1, cold=True),
        # The oracle is the reference implementation: injected faults emulate the stack under test.
        "oracle": Launch(f"triage-oracle{suffix}", config, world_size=1, entry=ORACLE_ENTRY, inject=False, cold=True),
    }


def model_suffix(model: str | None) -> str:
    """What a launch's key (or a case's name) adds for a user's model (--gpuregress-model): nothing for the scenario's."""
    return f"-{model}" if model else ""


def support_of(sc: Scenario) -> TriageSupport:
    """What triage needs of ``sc``; only scenarios that compose it are ever triaged."""
    if sc.triage is None:
        raise TypeError(f"scenario {sc.name!r} composes no TriageSupport: triage cannot explain it")
    return sc.triage


def _bound(sc: Scenario, config: dict[str, Any]) -> float:
    tokens, layers = support_of(sc).step0_terms(config)
    return step0_bound(str(config.get("dtype", "fp32")), tokens, layers)


def equivalence(sc: Scenario, n: RunRecord, one: RunRecord, setup: Setup) -> Experiment:
    """N ranks against one rank on the same global batch: step-0 gradients and first losses."""
    bound = _bound(sc, n.config)
    lines: list[str] = []
    ranks: set[int] = set()
    shapes = {name: _shape(one, name) for name in step0.names(one)}
    for name, shape in shapes.items():
        dev = step0.step0_deviation(n, one, name)
        if dev is None:
            lines.append(f"{name}: missing or reshaped in the {setup.world_size}-rank run")
            continue
        wrong = np.nonzero(dev > step0_limit(one, name, bound))[0]
        if not len(wrong):
            continue
        flat, unit, first = _where_wrong(one, name, wrong, shape)
        owners = sorted({shard_owner(i, shape, setup.world_size) for i in flat})
        ranks.update(owners)
        lines.append(
            f"{name} {list(shape)}: {len(wrong)} {unit} beyond {bound:.2g} (max {float(dev.max()):.3g}, "
            f"first at {first}), in the shard of rank {', '.join(map(str, owners))}; carried by "
            f"{support_of(sc).message_of(name, shapes, setup.world_size, n)}"  # n: the run that sent these messages
        )
    losses = rel(np.asarray(n.series.get("loss", [])), np.asarray(one.series.get("loss", [])))
    late = np.nonzero(losses > bound)[0]
    if len(late):
        lines.append(f"loss: {len(late)} of the first {len(losses)} steps beyond {bound:.2g}, first at step {late[0]} "
                     f"(rel {float(losses[late[0]]):.3g})")
    if not lines:
        return Experiment("equivalence", "clean", f"{setup.world_size} ranks and 1 rank agree at step 0 within "
                                                   f"{bound:.2g} (max {_max_step0_deviation(n, one):.2g})")
    where = f"rank {', '.join(map(str, sorted(ranks)))}" if ranks else "the losses"
    return Experiment("equivalence", "differs",
                      f"{setup.world_size} ranks differ from 1 rank at step 0 beyond {bound:.2g}, in {where}",
                      component="collective", lines=lines)


def _where_wrong(record: RunRecord, name: str, wrong: np.ndarray, shape: tuple[int, ...]) -> tuple[list[int], str, str]:
    """The flat index of each wrong element (a block's first element stands for the block), their unit, and where
    the first one is."""
    prefix, rows = step0.full_or_blocks(record, name)  # type: ignore[misc]
    if prefix == step0.BLOCK_PREFIX:
        return [int(rows[i, 0]) * step0.BLOCK for i in wrong], "blocks", step0.block_label(rows, int(wrong[0]), shape)
    return [int(i) for i in wrong], "elements", str(tuple(int(i) for i in np.unravel_index(int(wrong[0]), shape)))


def oracle(sc: Scenario, real: RunRecord, exact: RunRecord) -> Experiment:
    """A real run's step 0 against float64: loss, gradient norms and gradients."""
    bound = _bound(sc, real.config)
    lines: list[str] = []
    loss = float(rel(np.asarray(real.series["loss"][:1]), np.asarray(exact.series["loss"]))[0])
    if loss > bound:
        lines.append(f"step-0 loss: {real.series['loss'][0]!r} against float64 {exact.series['loss'][0]!r} "
                     f"(rel {loss:.3g} > {bound:.2g})")
    names = exact.param_names
    norms = rel(by_name.param_grad_norms(exact, real)[0][0], exact.arrays["param_grad_norm"][0])  # type: ignore[index]
    for i in np.nonzero(norms > bound)[0]:
        lines.append(f"step-0 gradient norm of {names[int(i)]}: rel {float(norms[int(i)]):.3g} > {bound:.2g}")
    for name in step0.names(exact):
        deviations = step0.step0_deviation(real, exact, name)
        allowed = step0_limit(exact, name, bound)
        if deviations is None or bool(np.any(deviations > allowed)):
            dev = float("inf") if deviations is None else float(deviations.max(initial=0.0))
            blocks = "" if np.ndim(allowed) == 0 else " (in blocks, each held to the bound of its sum)"
            lines.append(f"step-0 gradient {name}: max |diff|/max|float64| {dev:.3g} > {bound:.2g}{blocks}")
    if not lines:  # then every gradient was there to compare
        return Experiment("oracle", "clean", f"step 0 matches float64 within {bound:.2g} (loss rel {loss:.2g}, "
                                              f"gradients {_max_step0_deviation(real, exact):.2g})")
    return Experiment("oracle", "differs", f"step 0 differs from float64 beyond {bound:.2g} ({len(lines)} quantities)",
                      component="kernel", lines=lines)


def shard_owner(flat_index: int, shape: tuple[int, ...], world: int) -> int:
    """The rank whose FSDP2 shard (dim 0, padded to a multiple of the world size) holds this element."""
    rows = shape[0] if shape else 1
    per_row = int(np.prod(shape[1:]))  # 1 for a vector
    return min(world - 1, (flat_index // per_row) // -(-rows // world))


def _max_step0_deviation(a: RunRecord, b: RunRecord) -> float:
    found = (step0.step0_deviation(a, b, name) for name in step0.names(b))
    return max((float(d.max(initial=0.0)) for d in found if d is not None), default=0.0)


def _shape(record: RunRecord, name: str) -> tuple[int, ...]:
    """A parameter's shape: from its whole step-0 gradient, else from its final-weight digest."""
    whole = record.arrays.get(step0.FULL_PREFIX + name)
    return tuple(whole.shape) if whole is not None else tuple(record.digests.get(name, {}).get("shape", ()))


def cheap_evidence(sc: Scenario, setup: Setup, run: Runner, model: str | None = None) -> list[Experiment]:
    """Equivalence and oracle, from three short launches (cached by the runner)."""
    planned = launches(sc, setup, model)
    # One rank against one rank would clear the collectives without testing them.
    n = run(sc, planned["n"]) if setup.world_size >= 2 else None
    one, exact = run(sc, planned["one"]), run(sc, planned["oracle"])
    same = equivalence(sc, n, one, setup) if n is not None else \
        Experiment("equivalence", "not applicable", "needs 2 or more ranks: this run has 1")
    # The oracle judges the one-rank run: no collective touches it, so a difference there is the kernels'.
    return [same, oracle(sc, one, exact)]


def session_checks(name: str, passed: int, failed: list[str]) -> Experiment:
    """What a check scenario that ran in this session says on a failure elsewhere (the collective sweep, beside a
    training failure): evidence only, never a conviction, since the two may fail for causes of their own."""
    if failed:
        return Experiment(name, "fails too", f"{len(failed)} of {passed + len(failed)} of its cases failed in this "
                                             f"session, first {failed[0]}")
    return Experiment(name, "clean", f"its {passed} cases passed in this session, so a bug in the collectives "
                                     "would need what they do not vary (this run's message sizes, its process "
                                     "groups, the copies around each collective)")


def first_moved_evidence(comparison: Comparison) -> Experiment | None:
    """The op of step 0 that gave another answer (``Comparison.culprit``), convicting by what the op is (naming.py:
    op_component); a changed op sequence, or drift alone (the tolerant lane), convicts nothing."""
    if comparison.first_moved is None:
        return None
    moved = comparison.culprit
    if moved is None:  # the tolerant lane: ops moved, none beyond drift, so no op convicts anything
        drift = comparison.first_moved.describe().removeprefix("first difference: ")
        return Experiment("first moved op", "drift only", f"no op of step 0 moved beyond drift; it begins at {drift}")
    status = "differs" if moved.kind == "moved" else "sequence changed"  # a moved weight differs, naming nothing
    shape = f"; {comparison.shape_note}" if comparison.shape_note else ""
    return Experiment("first moved op", status, moved.describe().removeprefix(f"{moved.label}: ") + shape,
                      component=op_component(moved))


def verdict(comparison: Comparison | None, experiments: list[Experiment], rules: tuple[Rule, ...] = RULES) -> Verdict:
    """The verdict of the first rule of decision.RULES (or ``rules``) whose evidence is there; inconclusive (its
    component None) where none is: the findings then keep their own names, and the line says what is known."""
    evidence = Evidence(comparison, {e.name: e for e in experiments})
    # What the comparison itself shows, beside the experiments: the kernels that changed since the reference, and
    # the first op of step 0 that moved.
    changed = evidence.compared.kernel_changes
    if changed:
        evidence.by_name["kernels"] = Experiment("kernels", "changed", f"{len(changed)} ops run other kernels than in "
                                                 f"the reference, first {changed[0]}", component="kernel")
    moved = first_moved_evidence(evidence.compared)
    if moved is not None:
        evidence.by_name[moved.name] = moved
    _divergence(evidence.compared, experiments, evidence.by_name)
    return decide(evidence, evidence.quote(*evidence.by_name), rules)


def _divergence(comparison: Comparison, experiments: list[Experiment], by_name: dict[str, Experiment]) -> None:
    """Where step 0 is cleared and the findings start later: say so, and whether a step's gradients moved while its
    loss (the same weights) matched, which clears the update. A first moved op at step 0 that drifts within the
    tolerance there is shown as drift, convicting nothing."""
    first = first_step(comparison)
    moved = by_name.get("first moved op")
    if first and moved is not None and moved.convicts and moved.component != "optimizer":
        # Step 0 is within the tolerance: that op's drift is the legitimate kind the envelope allows (another
        # kernel path), not what failed later; it is shown, and convicts nothing.
        by_name[moved.name] = Experiment(moved.name, "drifts within the tolerance at step 0", moved.detail)
    if divergence_start(comparison, experiments) is None:
        return
    update = "" if not gradients_moved_first(comparison.findings, comparison.lane) else (
        "; the gradients move before the loss (which is bitwise equal at that step), so the update is not the cause (a "
        "collective that carries gradients, or a backward kernel)")
    by_name["divergence"] = Experiment("divergence", "starts", f"step 0 matches the reference; the first difference is "
                                                               f"at step {first}{update}")


def divergence_start(comparison: Comparison, experiments: list[Experiment]) -> int | None:
    """The step a divergence starts at where step 0 is cleared (equivalence and the oracle ran, both clean) and
    the findings begin later; None otherwise."""
    cleared = [e.status for e in experiments if e.name in ("equivalence", "oracle")]
    first = first_step(comparison)
    return first if first and len(cleared) >= 2 and set(cleared) == {"clean"} else None


def report(line: str, experiments: list[Experiment]) -> list[str]:
    lines = ["", line]
    for e in experiments:
        lines += [f"    {e.name}: {x}" for x in e.lines[:12]]
    return lines
