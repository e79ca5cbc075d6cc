"""The op that introduced a difference (evidence/introduced.py): in the tolerant lane, where a new kernel path
moves many ops by a few ulps, the failure names the op whose output moved far more than its inputs explain, and
where drift began only as information. Step 0 of the tiny Llama traced in this process (tests/evidence/test_op_trace.py),
and hand-made traces for what one process cannot show (a collective's other ranks, bf16 inputs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pytest_gpuregress import triage
from pytest_gpuregress.comparison.report import format_comparison
from pytest_gpuregress.evidence import introduced
from pytest_gpuregress.evidence.op_trace import INPUT_OP, RankTrace, ranks
from pytest_gpuregress.evidence.trace_pairs import pair
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.triage.naming import op_component

from ..conftest import compare_named, make_record
from .test_op_trace import UP_PROJ, traced_step0

DOWN_PROJ = "model.layers.1.mlp.down_proj"
CLEAN_EXPERIMENTS = [triage.Experiment("equivalence", "clean", ""), triage.Experiment("oracle", "clean", "")]


def scaled(module: str, rel: float) -> Any:
    """A hook that scales ``module``'s output by (1 + rel) in place, as a kernel would, in a fault region."""
    import torch

    from pytest_gpuregress.training.kernels import fault_region

    def scale(_: Any, args: Any, output: Any) -> None:
        with fault_region(), torch.no_grad():
            output.detach().mul_(1 + rel)

    return module, scale


def traced(*scalings: tuple[str, Any], failing: bool = True) -> RunRecord:
    """Step 0 traced with each (module, hook) installed; ``failing``: its later losses off, so the run fails."""

    def install(model: Any) -> Any:
        handles = [model.get_submodule(module).register_forward_hook(hook) for module, hook in scalings]

        class Undo:
            @staticmethod
            def remove() -> None:
                for handle in handles:
                    handle.remove()

        return Undo()

    record = traced_step0(hook=install)
    if failing:
        record.series = {k: [vals[0], *(v * (1 + 1e-3) for v in vals[1:])] for k, vals in record.series.items()}
    return record


@pytest.fixture(scope="module")
def reference() -> RunRecord:
    """Step 0 of the clean model, recorded as a reference is: with today's thresholds beside its trace."""
    record = traced_step0()
    introduced.attach_thresholds(record.results)
    return record


def report(comparison: Any) -> str:
    return format_comparison(comparison, scenario="fsdp", platform_key="cpu-gloo-w1-fp32", reference_path="ref",
                             record_hint="record it")


def test_the_trace_keeps_the_entries_each_op_read(reference: RunRecord) -> None:
    trace = ranks(reference)[0]
    assert trace.has_sources
    up = next(i for i in range(len(trace)) if trace.entry(i).op == "aten::mm" and trace.entry(i).module == UP_PROJ)
    sources = [trace.entry(s) for s in trace.sources_of(up)]
    # the activation from the op before it, and the weight, read once as an input of this module
    assert [(s.op, s.module) for s in sources if s.op == INPUT_OP] == [(INPUT_OP, UP_PROJ)]
    assert all(s < up for s in trace.sources_of(up)) and len(sources) == 2


def test_a_gemm_error_after_drift_is_introduced_at_its_matmul_and_drift_is_information(reference: RunRecord) -> None:
    run = traced(scaled(UP_PROJ, 1e-7), scaled(DOWN_PROJ, 1e-3))  # 1 ulp of drift in layer 0, the bug in layer 1
    comparison = compare_named(reference, run, lane="tolerant")
    culprit = comparison.culprit
    assert culprit is not None and culprit.entry is not None
    assert (culprit.entry.op, culprit.entry.module, op_component(culprit)) == ("aten::mm", DOWN_PROJ, "kernel")
    assert comparison.first_moved is not None and comparison.first_moved.entry.module == UP_PROJ  # drift first
    assert (culprit.label, culprit.entry.phase, comparison.first_moved.entry.phase) == \
        ("introduced at", "forward", "forward")
    # its output moved 1e-3 relative, 8.39e3 ulps, against its inputs' move (as the report prints them)
    assert (f"{culprit.relative:.1e}", f"{culprit.ulps:.3g}") == ("1.0e-03", "8.39e+03")
    assert culprit.inputs_relative is not None and culprit.inputs_relative < culprit.relative / 1000
    text = report(comparison)
    assert culprit.describe() in text and "1.0e-03 relative (8.39e+03 ulps)" in text, text
    assert culprit.describe().startswith("introduced at: ") and f"drift begins at: aten::mm in {UP_PROJ}" in text
    run.series = {k: [v * (1 + 1e-3) for v in vals] for k, vals in run.series.items()}  # step 0 fails too
    failing = compare_named(reference, run, lane="tolerant")
    found = triage.verdict(failing, CLEAN_EXPERIMENTS)
    assert failing.culprit is not None and failing.culprit.entry is not None
    assert (failing.culprit.entry.op, failing.culprit.entry.module) == ("aten::mm", DOWN_PROJ)
    assert (found.component, found.rule) == ("kernel", "culprit-at-step0")
    assert f"differs: aten::mm in {DOWN_PROJ}" in found.line


def test_a_gemm_error_at_one_shape_only_depends_on_the_shape_and_the_report_names_the_shapes(
        reference: RunRecord) -> None:
    gate = UP_PROJ.replace("up_proj", "gate_proj")  # the same shape as up_proj: [tokens, 64] x [64, 176]
    comparison = compare_named(reference, traced(scaled(gate, 1e-3), scaled(UP_PROJ, 1e-3)), lane="tolerant")
    note = comparison.shape_note
    assert comparison.culprit is not None and comparison.culprit.entry is not None
    assert comparison.culprit.entry.op == "aten::mm"
    assert note is not None and note.startswith("depends on the shape: aten::mm "), note
    wrong, right = note.split(", and none at ")
    assert "x f32[64, 176] (2 ops)" in wrong and "x f32[64, 64]" in right and "f32[64, 176]" not in right
    assert f"    {note}" in report(comparison)
    evidence = triage.first_moved_evidence(comparison)
    assert evidence is not None and evidence.component == "kernel" and "depends on the shape" in evidence.detail


def test_a_gemm_error_in_one_module_of_a_shape_others_share_does_not_depend_on_the_shape(
        reference: RunRecord) -> None:
    comparison = compare_named(reference, traced(scaled(UP_PROJ, 1e-3)), lane="tolerant")
    assert comparison.culprit is not None and op_component(comparison.culprit) == "kernel"
    assert comparison.shape_note is None  # gate_proj has up_proj's shape and its inputs, and stayed right
    assert "depends on the shape" not in report(comparison)


def test_drift_alone_introduces_nothing_and_convicts_nothing(reference: RunRecord) -> None:
    comparison = compare_named(reference, traced(scaled(UP_PROJ, 1e-7)), lane="tolerant")
    assert not comparison.passed and comparison.first_moved is not None and comparison.culprit is None
    text = report(comparison)
    stored = introduced.stored_thresholds(reference)
    assert stored is not None and stored.floor_ulps == 32
    assert comparison.introduced_rule == introduced.describe_thresholds(reference)
    assert "introduced at: no op of step 0" in text
    assert f"({comparison.introduced_rule})" in text
    assert f"drift begins at: aten::mm in {UP_PROJ}" in text
    evidence = triage.first_moved_evidence(comparison)
    assert evidence is not None and evidence.status == "drift only" and not evidence.convicts
    found = triage.verdict(comparison, CLEAN_EXPERIMENTS)
    component, line = found.component, found.line
    assert (component, found.rule) == (None, None)
    assert evidence.detail in found.evidence and found.evidence in line


def test_the_exact_lane_still_names_the_first_op_that_moved(reference: RunRecord) -> None:
    comparison = compare_named(reference, traced(scaled(UP_PROJ, 1e-7)), lane="exact")
    assert comparison.culprit is comparison.first_moved and comparison.introduced is None
    assert f"first difference: aten::mm in {UP_PROJ}" in report(comparison)


def test_a_one_element_gradient_error_is_pinned_on_no_op_downstream(reference: RunRecord) -> None:
    """One gradient element off by 1e-3 (a sparse collective error): its digest moves like drift, so no op can
    be shown to have introduced it; the ops downstream that gather it (clipping's per-parameter norms) or weigh
    it by a large operand (RMSNorm's backward, 190x) move far more than their inputs' digests, and are not named."""
    import torch

    from pytest_gpuregress.training.kernels import fault_region

    def nudge(_: Any, grad_input: Any, grad_output: Any) -> None:
        with fault_region(), torch.no_grad():
            grad_output[0].view(-1)[7] *= 1 + 1e-3

    def install(model: Any) -> Any:
        return model.get_submodule(DOWN_PROJ).register_full_backward_hook(nudge)

    run = traced_step0(hook=install)
    run.series = {k: [vals[0], *(v * (1 + 1e-3) for v in vals[1:])] for k, vals in run.series.items()}
    comparison = compare_named(reference, run, lane="tolerant")
    assert comparison.first_moved is not None and comparison.first_moved.entry.phase == "backward"
    culprit = comparison.culprit
    assert culprit is None, culprit.describe()  # RMSNorm's backward multiplies it 190x in digest terms: not named


# --- hand-made traces: two ranks, bf16 --------------------------------------------------------------------------


def trace_of(entries: list[tuple[str, str, list[int], list[float]]]) -> RankTrace:
    """(op, output shape, sources, digest (sum, sum |x|, max |x|)) per entry; the hash from the digest."""
    rows = [(op, "m", "", "backward", "", [shape]) for op, shape, _, _ in entries]
    digests = [[(*d, hash(tuple(d)) & 0xFFFF)] for _, _, _, d in entries]
    return RankTrace.of_entries(rows, digests, backend="test", hash_kind="test", seconds=0.0,
                                sources=[s for _, _, s, _ in entries])


def record_of(*traces: RankTrace) -> RunRecord:
    record = make_record()
    record.results, record.arrays = {}, dict(record.arrays)
    for rank, trace in enumerate(traces):
        trace.store(rank, record.results, record.arrays)
    introduced.attach_thresholds(record.results)
    return record


def reduce_scatter(rank_inputs: list[float], output: float) -> RankTrace:
    return trace_of([(INPUT_OP, "f32[8]", [], [rank_inputs[0], 8.0, 1.0]),
                     ("aten::mul", "f32[8]", [0], [rank_inputs[1], 8.0, 1.0]),
                     ("c10d::_reduce_scatter_base_", "f32[4]", [1], [output, 4.0, 1.0])])


def test_a_collective_weighs_every_ranks_inputs() -> None:
    ref = record_of(reduce_scatter([1.0, 2.0], 3.0), reduce_scatter([1.0, 2.0], 3.0))
    # rank 1's input moved by 1e-3 (its own bug, upstream); rank 0's reduce-scatter output holds it
    moved_upstream = record_of(reduce_scatter([1.0, 2.0], 3.0 + 4e-3), reduce_scatter([1.0, 2.0 + 8e-3], 3.0 + 4e-3))
    found = introduced.introduced_at(ref, moved_upstream)
    assert found is not None and found.entry is not None and found.entry.op == "aten::mul" and found.rank == 1
    before, after = ranks(ref), ranks(moved_upstream)
    moves = {r: introduced._Moves.of(before[r], after[r], pair(before[r], after[r])) for r in (0, 1)}
    alone = introduced._first_in_rank(after[0], moves[0], [], introduced.DEFAULT)
    assert alone is not None and alone[0] == 2  # rank 0 alone: its inputs are equal, its output moved
    assert introduced._first_in_rank(after[0], moves[0], [(after[1], moves[1])], introduced.DEFAULT) is None
    # inputs as they were, the collective's output scaled: it introduced the difference
    scaled_output = record_of(reduce_scatter([1.0, 2.0], 3.0 + 4e-3), reduce_scatter([1.0, 2.0], 3.0 + 4e-3))
    found = introduced.introduced_at(ref, scaled_output)
    assert found is not None and found.entry is not None and op_component(found) == "collective"


def test_values_rounded_to_bf16_move_by_bf16_units_in_every_float32_op_they_reach() -> None:
    def chain(weight_sum: float, norm_sum: float, rsqrt_max: float) -> RankTrace:
        return trace_of([(INPUT_OP, "bf16[64]", [], [weight_sum, 64.0, 1.0]),
                         ("aten::_to_copy", "f32[64]", [0], [weight_sum, 64.0, 1.0]),
                         ("aten::mean", "f32[8]", [1], [norm_sum, 8.0, 1.0]),
                         ("aten::rsqrt", "f32[8]", [2], [8.0, 8.0, rsqrt_max])])

    ref = record_of(chain(1.0, 2.0, 1.0))
    # the bf16 input moved a little, the smallest mean a lot, its rsqrt (the largest) by 4e-4: 3400 float32
    # ulps, yet 0.05 of bf16's, which is where those values were rounded
    run = record_of(chain(1.0 + 1e-4, 2.0 + 1e-5, 1.0 + 4e-4))
    assert introduced.introduced_at(ref, run) is None
    as_float32 = record_of(trace_of([(INPUT_OP, "f32[64]", [], [1.0, 64.0, 1.0]),
                                     ("aten::mean", "f32[8]", [0], [2.0, 8.0, 1.0]),
                                     ("aten::rsqrt", "f32[8]", [1], [8.0, 8.0, 1.0])]))
    moved = record_of(trace_of([(INPUT_OP, "f32[64]", [], [1.0, 64.0, 1.0]),
                                ("aten::mean", "f32[8]", [0], [2.0 + 1e-7, 8.0, 1.0]),
                                ("aten::rsqrt", "f32[8]", [1], [8.0, 8.0, 1.0 + 4e-4])]))
    found = introduced.introduced_at(as_float32, moved)
    assert found is not None and found.entry is not None and found.entry.op == "aten::rsqrt"


def test_thresholds_are_read_from_the_reference_and_a_record_without_sources_is_not_analysed() -> None:
    ref = record_of(reduce_scatter([1.0, 2.0], 3.0))
    assert introduced.stored_thresholds(ref) == introduced.DEFAULT
    stricter = record_of(reduce_scatter([1.0, 2.0], 3.0))
    stricter.results["op_trace"][introduced.INTRODUCED_KEY] = {"floor_ulps": 1e9, "amplification": 100.0}
    run = record_of(reduce_scatter([1.0, 2.0], 3.0 + 4e-3))
    assert introduced.introduced_at(ref, run) is not None and introduced.introduced_at(stricter, run) is None
    unsourced = record_of(reduce_scatter([1.0, 2.0], 3.0))
    for key in [k for k in unsourced.arrays if k.endswith(("/sources", "/source_counts"))]:
        del unsourced.arrays[key]
    assert not introduced.analysed(unsourced, run) and introduced.introduced_at(unsourced, run) is None
    assert introduced.epsilon("bf16[8, 64]") == 2.0**-7 and introduced.epsilon("i64[4]") == 1.0
    assert introduced.numel(("f32[8, 64]", "f32[]")) == 513 and np.isclose(introduced.DEFAULT.floor_ulps, 32.0)


def test_the_scale_mode_of_the_collective_fault_scales_every_element_and_only_floats() -> None:
    """``collective:mode=scale``, the e2e case's dense reduce-scatter error: an AVG divided by the wrong count."""
    import torch

    from pytest_gpuregress.faults import parse
    from pytest_gpuregress.faults.collective import CollectiveFault

    fault = CollectiveFault(parse("collective:op=reduce_scatter,mode=scale,rel=1e-3"), rank=0, world_size=2)
    out = torch.arange(1.0, 9.0)
    fault.after("reduce_scatter", 32, out, None)
    assert fault.fired == 1 and torch.equal(out, torch.arange(1.0, 9.0) * (1 + 1e-3))
    ints = torch.arange(8)
    fault.after("reduce_scatter", 32, ints, None)
    assert fault.fired == 1 and torch.equal(ints, torch.arange(8))  # nothing to scale: not fired



def test_a_changed_op_sequence_is_a_note_and_the_analysis_goes_on_past_it() -> None:
    """The library wrote SiLU anew (aten::mul became aten::sigmoid): that op has no partner, so it is said as a
    change of the sequence, and the reduce-scatter after it is still paired and judged, by its nearest paired
    ancestor's move (the input, unmoved)."""
    ref = record_of(reduce_scatter([1.0, 2.0], 3.0))

    def rewritten(output: float) -> RunRecord:
        record = record_of(trace_of([(INPUT_OP, "f32[8]", [], [1.0, 8.0, 1.0]),
                                     ("aten::sigmoid", "f32[8]", [0], [2.0, 8.0, 1.0]),
                                     ("c10d::_reduce_scatter_base_", "f32[4]", [1], [output, 4.0, 1.0])]))
        record.series = {k: [v * (1 + 1e-3) for v in vals] for k, vals in record.series.items()}
        return record

    comparison = compare_named(ref, rewritten(3.0), lane="tolerant")
    assert comparison.introduced is None and comparison.first_moved is None and comparison.culprit is None
    note = "1 op differs at the same place: aten::mul in `m` (backward): op aten::mul -> aten::sigmoid"
    assert comparison.sequence_notes[0] == note
    text = report(comparison)
    assert f"    {note}" in text and "op sequence changed since the reference" in text
    assert triage.first_moved_evidence(comparison) is None  # no op moved: nothing convicts
    # The collective past the change moved, far beyond what its (paired) ancestor explains: introduced there.
    comparison = compare_named(ref, rewritten(3.0 + 4e-3), lane="tolerant")
    culprit = comparison.culprit
    assert culprit is not None and culprit.entry is not None and culprit.entry.op == "c10d::_reduce_scatter_base_"
    assert op_component(culprit) == "collective" and comparison.sequence_notes[0] == note
    assert comparison.paired_ops == (2, 3)
    assert comparison.sequence_notes[1].startswith("only 2 of this run's 3 ops could be paired")
    # In the exact lane a changed sequence is the first difference, named with the field that differs.
    exact = compare_named(ref, rewritten(3.0), lane="exact")
    assert exact.culprit is not None and exact.culprit.kind == "sequence"
    changed = exact.culprit
    assert changed.entry is not None and changed.reference is not None and changed.entry_index == 1
    assert (changed.reference.op, changed.entry.op, changed.entry.module, changed.entry.phase) == \
        ("aten::mul", "aten::sigmoid", "m", "backward")
    said = changed.describe()
    assert said.startswith("the op sequence changed at op 1: ") and ": op aten::mul -> aten::sigmoid" in said


def test_a_collective_on_ranks_whose_traces_differ_weighs_only_the_ranks_that_ran_it() -> None:
    """MoE routing can make ranks run other ops: a rank whose trace is shorter, or holds another op at that
    place, is left out of the collective's inputs instead of failing the comparison or pairing another op."""
    ref = record_of(reduce_scatter([1.0, 2.0], 3.0), trace_of([(INPUT_OP, "f32[8]", [], [1.0, 8.0, 1.0])]))
    run = record_of(reduce_scatter([1.0, 2.0], 3.0 + 4e-3), trace_of([(INPUT_OP, "f32[8]", [], [1.0, 8.0, 1.0])]))
    found = introduced.introduced_at(ref, run)
    assert found is not None and found.entry is not None and found.entry.op == "c10d::_reduce_scatter_base_"


def test_an_op_that_writes_into_an_input_in_place_becomes_its_source() -> None:
    import torch

    from pytest_gpuregress.evidence.op_tracer import _Storages

    storages, weight = _Storages(), torch.ones(4)
    assert storages.first_read(weight)
    storages.wrote(weight, 3, as_input=True)
    assert storages.writer(weight) == 3  # read as an input
    storages.wrote(weight, 9)  # AdamW's step writes it in place
    assert storages.writer(weight) == 9
    storages.close()
