"""Triage's verdict and shard arithmetic, without launching ranks."""

from __future__ import annotations

import re
from types import SimpleNamespace

from pytest_gpuregress.comparison.bounds import step0_bound
from pytest_gpuregress.comparison.compare import Comparison
from pytest_gpuregress.triage import Experiment, shard_owner, verdict
from pytest_gpuregress.triage.decision import RULE_BY_ID

from ..conftest import compare_named, make_record


class _Compared(SimpleNamespace):
    """A stand-in Comparison: the fields a rule reads, and its first-finding lookup."""

    finding = Comparison.finding


def _late_divergence():  # type: ignore[no-untyped-def]
    run = make_record()
    run.series["loss"] = run.series["loss"][:2] + [x * 1.01 for x in run.series["loss"][2:]]
    return compare_named(make_record(), run, lane="tolerant")


def test_the_oracle_outranks_equivalence() -> None:
    experiments = [Experiment("equivalence", "differs", "x", component="collective"),
                   Experiment("oracle", "differs", "y", component="kernel")]
    assert verdict(None, experiments).component == "kernel"


def test_equivalence_alone_convicts_a_collective() -> None:
    experiments = [Experiment("equivalence", "differs", "x", component="collective"), Experiment("oracle", "clean", "y")]
    found = verdict(None, experiments)
    component, line = found.component, found.line
    assert (component, found.rule, found.quoted) == ("collective", "equivalence", "equivalence differs: x")
    assert line.startswith("triage verdict: collective. ") and f"Evidence: {found.evidence}. " in line


def test_both_clean_and_a_later_divergence_without_a_window_is_inconclusive_not_the_optimizer() -> None:
    """Elimination is no evidence: a collective that goes wrong late (a warmed-up buffer pool) leaves step 0 clean
    too. Without the late window or the run's own invariants, the verdict says what is known."""
    experiments = [Experiment("equivalence", "clean", "x"), Experiment("oracle", "clean", "y")]
    found = verdict(_late_divergence(), experiments)
    component, line = found.component, found.line
    assert component is None and "inconclusive" in line and "the first difference is at step 2" in line


def test_both_clean_and_step_0_differing_is_inconclusive() -> None:
    run = make_record()
    run.arrays["step0_grad/a.weight"] = run.arrays["step0_grad/a.weight"] * 1.01
    experiments = [Experiment("equivalence", "clean", "x"), Experiment("oracle", "clean", "y")]
    found = verdict(compare_named(make_record(), run, lane="tolerant"), experiments)
    component, line = found.component, found.line
    assert component is None and "inconclusive" in line


def test_experiments_that_could_not_run_clear_nothing() -> None:
    experiments = [Experiment("equivalence", "not applicable", "x"), Experiment("oracle", "clean", "y")]
    assert verdict(_late_divergence(), experiments).component is None


def test_shard_owner_follows_fsdp2_dim0_sharding_with_padding() -> None:
    # 10 rows on 4 ranks: ceil(10/4) = 3 rows per rank; rows 9 belongs to rank 3 (padded shard).
    assert [shard_owner(row * 5, (10, 5), 4) for row in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert shard_owner(16, (64,), 2) == 0 and shard_owner(48, (64,), 2) == 1


def test_the_fp32_bound_on_the_cpu_model() -> None:
    assert abs(step0_bound("fp32", 16 * 64, 2) - 5.72e-6) < 1e-8
    assert step0_bound("bf16", 48 * 256, 8) > step0_bound("fp32", 48 * 256, 8)


def test_the_collective_sweep_of_the_session_is_evidence_never_a_conviction() -> None:
    from pytest_gpuregress.triage import session_checks

    clean = session_checks("collective sweep", 12, [])
    failing = session_checks("collective sweep", 10, ["collectives-reduce_scatter-single-sum-fp32-n1-outofplace"])
    assert (clean.status, failing.status) == ("clean", "fails too") and not clean.convicts and not failing.convicts
    assert "its 12 cases passed in this session" in clean.detail
    assert "2 of 12 of its cases failed" not in failing.detail and "1 of 11 of its cases failed" in failing.detail
    experiments = [Experiment("equivalence", "clean", "x"), Experiment("oracle", "clean", "y"), failing]
    found = verdict(_late_divergence(), experiments)
    component, line = found.component, found.line
    # A failing sweep beside it convicts nothing (the two may fail for causes of their own).
    assert (component, found.rule) == (None, None)
    sweep = f"{failing.name} fails too: {failing.detail}"
    assert sweep in found.evidence and found.evidence in line


def test_the_docs_table_of_rules_is_the_decision_tables() -> None:
    """docs/triage.md shows the rules triage/decision.py decides by, in their order, word for word."""
    from pathlib import Path

    from pytest_gpuregress.triage import decision

    text = (Path(__file__).resolve().parents[2] / "docs" / "triage.md").read_text()
    shown = text[text.index(decision.BEGIN) + len(decision.BEGIN):text.index(decision.END)].strip().splitlines()
    assert shown == decision.markdown_table()


def test_the_docs_tables_of_naming_rules_are_the_naming_tables() -> None:
    """docs/triage.md shows the rules triage/naming.py names findings by, in their order, word for word."""
    from pathlib import Path

    from pytest_gpuregress.triage import naming

    text = (Path(__file__).resolve().parents[2] / "docs" / "triage.md").read_text()
    for marker, table in (("finding-rules", naming.finding_rules_table()),
                          ("check-rules", naming.markdown_table(naming.CHECK_RULES))):
        begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
        assert text[text.index(begin) + len(begin):text.index(end)].strip().splitlines() == table, marker


def test_in_run_evidence_outranks_the_experiments_and_is_quoted() -> None:
    """The run's own collective invariants decide before N ranks against one; a bisect before everything."""
    broke = Experiment("collective invariants", "broke", "step 100: all_gather ...", component="collective")
    oracle = Experiment("oracle", "differs", "y", component="kernel")
    found = verdict(None, [oracle, broke])
    component, line = found.component, found.line
    assert (component, found.rule) == ("collective", "collective-invariants")
    assert found.quoted == f"{broke.name} broke: {broke.detail}"
    rule = RULE_BY_ID["collective-invariants"]
    assert f"Decided by rule {rule.id} ({rule.evidence})" in line
    named = Experiment("bisect", "named", "transformers 5.25.0 -> 5.24.0 restores step 0 ...",
                       component="library: transformers")
    assert verdict(None, [oracle, broke, named]).component == "library: transformers"


def test_a_collective_that_introduced_step_0s_difference_outranks_the_clip_that_read_its_output() -> None:
    """The helper's 11i: DDP's all-reduce (the C++ reducer, which the ledger does not see) gives rank 1 the SUM. The
    clip then reads gradients the ranks no longer agree on and looks inconsistent; the op of step 0 that introduced
    the difference is the all-reduce itself, and that decides first."""
    from types import SimpleNamespace

    import numpy as np

    from pytest_gpuregress.evidence.first_moved import FirstMoved
    from pytest_gpuregress.evidence.op_trace import TraceOp
    from pytest_gpuregress.triage.decision import Evidence, decide

    def entry(op: str) -> TraceOp:
        return TraceOp(40, op, "(root)", "", "backward", "f32[1024]", ("f32[1024]",), np.zeros((1, 3)), np.zeros(1))

    allreduce = FirstMoved(1, "moved", entry("c10d::allreduce_"), entry("c10d::allreduce_"), 39, 1.0, 2)
    comparison = _Compared(findings=[SimpleNamespace(step=0, metric="step0_grad")], culprit=allreduce, paired_ops=None)
    clip = Experiment("clip", "inconsistent", "the clip reported another norm ...", component="optimizer")
    first = Experiment("first moved op", "differs", allreduce.describe(), component="collective")
    found = decide(Evidence(comparison, {"clip": clip, "first moved op": first}))  # type: ignore[arg-type]
    assert (found.component, found.rule) == ("collective", "collective-at-step0") and "c10d::allreduce_" in found.quoted
    later = _Compared(findings=[SimpleNamespace(step=5, metric="loss")], culprit=None, paired_ops=None)
    assert decide(Evidence(later, {"clip": clip})).rule == "clip"  # type: ignore[arg-type]


def test_ops_added_in_one_packages_code_name_it_unless_a_backend_of_torchs_was_swapped() -> None:
    """A bf16 norm that lost its float32 upcast runs fewer ops in transformers' code: [library: transformers]. SDPA
    forced onto its math backend also runs other ops in transformers' attention module, under the same call: that
    is torch's dispatch, and the kernels' rule decides."""
    from pytest_gpuregress.comparison.compare import Finding as Found
    from pytest_gpuregress.triage.decision import Evidence, _code_changed, _less_precise_same_code

    def evidence(swapped: str | None) -> Evidence:
        comparison = _Compared(changed_code=["transformers", "torch"], swapped_backend=swapped,
                                     sequence_notes=["26 ops of the reference no longer run in `norm`"],
                                     findings=[Found("step0_precision", "further", step=0)])
        return Evidence(comparison, {})  # type: ignore[arg-type]

    assert _code_changed(evidence(None)) == ("library: transformers", "ops of step 0 inserted or removed in "
                                             "transformers's code: 26 ops of the reference no longer run in `norm`")
    assert _less_precise_same_code(evidence(None)) is None
    swapped = evidence("aten::_scaled_dot_product_flash_attention_for_cpu")
    assert _code_changed(swapped) is None and _less_precise_same_code(swapped)[0] == "kernel"  # type: ignore[index]


def test_rules_have_stable_unique_ids_that_verdicts_name() -> None:
    """Tests, JUnit and the docs name a rule by its id, so inserting a rule renames none."""
    from pytest_gpuregress.triage import decision

    ids = [rule.id for rule in decision.RULES]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", i) for i in ids)
    assert {"bisect", "data", "collective-invariants", "clip", "oracle", "equivalence", "model-layout",
            "step0-gradients-either"} <= set(ids)
    inconclusive = decision.decide(decision.Evidence(None, {}))
    assert (inconclusive.component, inconclusive.rule) == (None, None)
    assert inconclusive.line.startswith("triage verdict: inconclusive")


def test_an_op_found_among_too_few_paired_ops_decides_nothing_alone_and_the_verdict_says_so() -> None:
    """Where less than half of step 0 could be paired (a wrapper inserted casts everywhere), the op named as
    introducing the difference was looked for among too few ops: no rule reads it, and the verdict counts them."""
    from types import SimpleNamespace

    from pytest_gpuregress.triage.decision import Evidence, decide

    kernel_op = SimpleNamespace(site="compute", entry=None, world=2, also_on=(), arguments_changed=False)
    first = Experiment("first moved op", "differs", "aten::mm in q_proj", component="kernel")
    same = {"findings": [SimpleNamespace(step=0, metric="loss")], "culprit": kernel_op, "changed_code": [],
            "swapped_backend": None, "new_dtypes": [], "reordered": False}
    paired = _Compared(**same, paired_ops=(400, 728))
    assert decide(Evidence(paired, {"first moved op": first})).rule == "culprit-at-step0"  # type: ignore[arg-type]
    unpaired = _Compared(**same, paired_ops=(314, 728))
    found = decide(Evidence(unpaired, {"first moved op": first}))  # type: ignore[arg-type]
    assert (found.component, found.rule) == (None, None)
    assert "only 314 of this run's 728 ops of step 0 could be paired" in found.line


def test_a_weight_that_arrives_at_an_op_is_no_data() -> None:
    """Data is the token batch: integers the step read. A float input (a weight, a buffer) that moved names nothing."""
    import numpy as np

    from pytest_gpuregress.evidence.first_moved import FirstMoved
    from pytest_gpuregress.evidence.op_trace import INPUT_OP, TraceOp
    from pytest_gpuregress.triage.naming import op_component

    def moved_input(dtype: str) -> FirstMoved:
        entry = TraceOp(3, INPUT_OP, "model.layers.0.q_proj.lora_B", "", "forward", "", (f"{dtype}[64, 8]",),
                        np.zeros((1, 3)), np.zeros(1))
        return FirstMoved(0, "moved", entry, entry, 3, 1.0, 2)

    assert op_component(moved_input("i64")) == "data"
    assert op_component(moved_input("f32")) is None


def test_gradients_exactly_world_size_times_the_reference_are_a_divide_skipped() -> None:
    """torch 2.8's gloo AVG reduce-scatter summed: every gradient came out 2x at 2 ranks. Without the run's
    collective invariants nothing tells that AVG from a caller that did not divide; with them held, it is the caller."""
    from types import SimpleNamespace

    import numpy as np

    from pytest_gpuregress.comparison.compare import arithmetic_of, uniform_factor
    from pytest_gpuregress.triage.decision import INVARIANTS, Evidence, decide

    rng = np.random.default_rng(0)
    expected = rng.normal(0, 1e-3, 4096)
    assert uniform_factor(expected, 2 * expected) == 2.0 and arithmetic_of(2.0, 2) == "the world size 2"
    assert arithmetic_of(0.25, 4) == "1 / the world size 4" and arithmetic_of(3.0, 2) is None
    assert uniform_factor(expected, expected * (1 + rng.normal(0, 1e-2, 4096))) is None  # a kernel's error: no factor
    assert uniform_factor(expected, expected * (1 + 1e-7)) is None  # drift is no factor

    def gradients(factor_is: str | None) -> SimpleNamespace:
        grad = SimpleNamespace(metric="late_grad", step=None, factor=2.0, factor_is=factor_is)
        return _Compared(findings=[grad, grad], culprit=None, paired_ops=None, changed_code=[],
                               swapped_backend=None, new_dtypes=[], reordered=False)

    alone = decide(Evidence(gradients("the world size 2"), {}))  # type: ignore[arg-type]
    assert (alone.component, alone.rule) == ("collective or library", "world-size-factor")
    assert "every element exactly 2x the reference's: the world size 2" in alone.quoted
    held = Experiment(INVARIANTS, "held", "every reduce-scatter kept its invariants")
    caller = decide(Evidence(gradients("the world size 2"), {INVARIANTS: held}))  # type: ignore[arg-type]
    assert (caller.component, caller.rule) == ("library", "world-size-factor")  # no op says whose code: no package
    seed = SimpleNamespace(site="compute", package="torch", entry=SimpleNamespace(package="torch"),
                           describe=lambda: "aten::ones_like in no module (backward), f32[]")
    seeded = gradients("1 / the world size 2")
    seeded.culprit = seed  # a backward seed of 1/N, where autograd makes it
    named = decide(Evidence(seeded, {INVARIANTS: held}))  # type: ignore[arg-type]
    assert (named.component, named.rule) == ("library: torch", "world-size-factor")
    assert "aten::ones_like in no module (backward)" in named.quoted
    assert decide(Evidence(gradients(None), {})).rule != "world-size-factor"  # type: ignore[arg-type]
