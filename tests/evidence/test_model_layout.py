"""The model component (evidence/model_layout.py): a parameter layout that differs from the reference's is
named as the model's own code changing, with the library versions, and never blamed on a kernel or collective."""

from __future__ import annotations

import copy

import numpy as np

from pytest_gpuregress.evidence import model_layout
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.resources import shipped_dir
from pytest_gpuregress.triage.naming import convict

from ..conftest import compare_named

FUSED = "model.layers.0.mlp.experts.gate_up_proj"


def moe_record(per_expert: bool, transformers: str) -> RunRecord:
    """A record of a 4-expert MoE layer: transformers 5.x keeps experts fused in one tensor, 4.57 per expert."""
    arrays = {"step0_grad/model.layers.0.self_attn.q_proj.weight": np.full((8, 8), 0.5, dtype=np.float32)}
    if per_expert:
        for e in range(4):
            arrays[f"step0_grad/model.layers.0.mlp.experts.{e}.w1.weight"] = np.full((6, 8), 0.1, dtype=np.float32)
            arrays[f"step0_grad/model.layers.0.mlp.experts.{e}.w3.weight"] = np.full((6, 8), 0.1, dtype=np.float32)
    else:
        arrays[f"step0_grad/{FUSED}"] = np.full((4, 12, 8), 0.1, dtype=np.float32)
    return RunRecord(scenario="fsdp", config={}, platform_key="cpu-gloo-w2-fp32", world_size=2,
                     fingerprint={"versions": {"transformers": transformers, "torch": "2.13.0"}},
                     series={"loss": [5.5, 5.4] if per_expert else [5.6, 5.3]}, arrays=arrays)


def test_a_fused_to_per_expert_layout_is_the_models_code_not_a_kernel() -> None:
    reference, run = moe_record(False, "5.24.0"), moe_record(True, "4.57.6")
    comparison = compare_named(reference, run, lane="exact")
    first = comparison.findings[0]
    assert first.component == "model" and first.metric == "model"
    assert model_layout.library_changes(reference, run) == ["transformers 5.24.0 -> 4.57.6"]
    before, after = model_layout.layout(reference), model_layout.layout(run)
    assert set(before) - set(after) == {FUSED} and len(set(after) - set(before)) == 8
    assert before[FUSED] == (4, 12, 8) and after["model.layers.0.mlp.experts.0.w1.weight"] == (6, 8)
    # the line names the libraries, how the layout moved (the same values regrouped) and to record anew
    assert first.message.startswith("the model's code changed with ") and "transformers 5.24.0 -> 4.57.6: " in first.message
    assert "1 parameters fused -> per-module as 8" in first.message and "(the same 384 values" in first.message
    assert f"{FUSED} [4, 12, 8] -> " in first.message and "--gpuregress-record" in first.message
    assert {f.component for f in comparison.findings} == {"model"}  # the loss that moved too: never a kernel


def test_triage_convicting_a_fault_keeps_the_model_finding_named_model() -> None:
    # A fault on a stack whose model layout also changed: the experiments convict the fault's component for the
    # numbers, but the layout line says what the library did, "not a kernel or collective fault", and keeps it.
    comparison = compare_named(moe_record(False, "5.24.0"), moe_record(True, "4.57.6"), lane="exact")
    convict(comparison, "collective", "equivalence")
    assert comparison.findings[0].metric == "model" and comparison.findings[0].component == "model"
    assert {f.component for f in comparison.findings[1:]} == {"collective"}


def test_the_report_of_a_changed_model_advises_a_folder_of_its_own_not_overwriting() -> None:
    from pytest_gpuregress.comparison.report import format_comparison

    comparison = compare_named(moe_record(False, "5.24.0"), moe_record(True, "4.57.6"), lane="exact")
    text = format_comparison(comparison, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="REF",
                             record_hint="OVERWRITE", record_elsewhere_hint="ELSEWHERE")
    assert "keeping this one: ELSEWHERE" in text and "OVERWRITE" not in text
    plain = compare_named(moe_record(False, "5.24.0"), moe_record(False, "5.24.0"), lane="exact")
    plain.findings = comparison.findings[1:]  # the same differences without a layout change
    text = format_comparison(plain, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="REF",
                             record_hint="OVERWRITE", record_elsewhere_hint="ELSEWHERE")
    assert "record them as the reference: OVERWRITE" in text and "ELSEWHERE" not in text


def test_an_unchanged_layout_gives_no_model_finding() -> None:
    reference, run = moe_record(False, "5.24.0"), moe_record(False, "5.24.0")
    run.arrays["step0_grad/model.layers.0.self_attn.q_proj.weight"] = run.arrays[
        "step0_grad/model.layers.0.self_attn.q_proj.weight"] * 1.001
    comparison = compare_named(reference, run, lane="exact")
    assert comparison.findings and all(f.component != "model" for f in comparison.findings)
    assert model_layout.layout_change(reference, run) is None


def test_the_shipped_moe_reference_with_a_reshaped_parameter_gets_the_model_verdict() -> None:
    """The real shipped tiny-moe reference against itself with one parameter's layout changed."""
    reference = store.read_reference(store.ReferenceLocation(shipped_dir("reference_runs"), "fsdp-tiny-moe",
                                                             "cpu-gloo-w2-fp32"))
    run = copy.deepcopy(reference)
    name = next(k for k in run.arrays if k.startswith(("step0_grad/", "step0_blocks/")) and "experts" in k)
    array = run.arrays.pop(name)
    run.arrays[name.replace("experts", "experts.0")] = array
    run.fingerprint.setdefault("versions", {})["transformers"] = "4.57.6"
    comparison = compare_named(reference, run, lane="exact")
    assert comparison.findings[0].component == "model"
    assert "transformers 5.24.0 -> 4.57.6" in comparison.findings[0].message
    assert all(f.component == "model" for f in comparison.findings)


def test_kernels_that_moved_with_a_model_library_alone_are_named_the_models_code() -> None:
    from pytest_gpuregress.comparison.observations import model_code_cause
    from pytest_gpuregress.evidence import kernels

    reference, run = moe_record(False, "5.24.0"), moe_record(False, "4.57.6")
    cause = model_code_cause(reference, run)
    assert model_layout.library_changes(reference, run) == ["transformers 5.24.0 -> 4.57.6"]
    assert cause.startswith("the model's code changed with ") and "transformers 5.24.0 -> 4.57.6: " in cause
    assert "not a kernel library" in cause and cause.endswith("(the model component)")
    assert kernels.report_lines(["aten::bmm: its own kernel -> mkl"], cause)[0].startswith(
        "kernels changed since the reference (1 ops; the model's code changed with transformers")
    run.fingerprint["versions"]["torch"] = "2.14.1"  # torch moved too: the kernels may be its
    assert model_code_cause(reference, run) == ""


def test_a_parameter_the_model_no_longer_has_is_its_definition_and_a_lora_adapter_is_peft() -> None:
    """A fresh-eyes fault: peft's LoraConfig lost one target module, so the model has no adapter there. No gradient
    and no final weight: the parameter is gone, not a gradient a stack fault dropped; only adapters differ, so the
    library that builds them is named, not the optimizer that no longer steps them."""
    def lora_record(with_down_proj: bool) -> RunRecord:
        names = ["q_proj.lora_A.default.weight", "q_proj.lora_B.default.weight"]
        names += ["down_proj.lora_A.default.weight", "down_proj.lora_B.default.weight"] if with_down_proj else []
        full = [f"base_model.model.model.layers.0.self_attn.{n}" for n in names]
        return RunRecord(scenario="lora", config={}, platform_key="cpu-gloo-w2-fp32", world_size=2,
                         fingerprint={"versions": {"peft": "0.21.2", "torch": "2.13.0"}}, series={"loss": [5.5, 5.4]},
                         arrays={f"step0_grad/{n}": np.full((8, 8), 0.5, dtype=np.float32) for n in full},
                         digests={n: {"sha256": "x", "sum": 1.0, "abs_sum": 2.0, "l2": 1.0, "shape": [8, 8]} for n in full})
    reference, run = lora_record(True), lora_record(False)
    assert model_layout.library_changes(reference, run) == []  # no library moved: the definition did
    change = model_layout.layout_change(reference, run)
    assert change is not None and change.startswith("the model's definition changed: ")
    assert "2 parameters only in the reference" in change
    assert model_layout.adapters_only(reference, run)
    comparison = compare_named(reference, run, lane="exact")
    assert (comparison.findings[0].component, comparison.findings[0].rule) == ("library: peft", "layout")
    assert {f.component for f in comparison.findings} == {"library: peft"}  # what follows from it too


def test_a_blocked_gradient_without_its_shape_on_one_side_is_no_layout_change() -> None:
    reference, run = moe_record(False, "5.24.0"), moe_record(False, "5.24.0")
    for record, shape in ((reference, [301, 77]), (run, None)):
        record.arrays["step0_blocks/a.weight"] = np.ones((23, 5))
        if shape:
            record.digests["a.weight"] = {"shape": shape}
    assert model_layout.layout_change(reference, run) is None


def test_gradients_only_missing_on_an_unchanged_library_stack_keep_the_usual_verdict() -> None:
    """A stack fault that leaves a parameter without a step-0 gradient is no model change: the usual findings
    name it. With a model library changed, the same is the model's code."""
    reference, run = moe_record(False, "5.24.0"), moe_record(False, "5.24.0")
    del run.arrays[f"step0_grad/{FUSED}"]
    assert model_layout.layout_change(reference, run) is None
    comparison = compare_named(reference, run, lane="exact")
    assert comparison.findings and all(f.component != "model" for f in comparison.findings)
    run.fingerprint["versions"]["transformers"] = "5.25.0"
    assert model_layout.library_changes(reference, run) == ["transformers 5.24.0 -> 5.25.0"]
    change = model_layout.layout_change(reference, run)
    assert change is not None and change.startswith("the model's code changed with ")
    assert "transformers 5.24.0 -> 5.25.0: " in change


def test_kernels_that_moved_with_other_stack_changes_are_not_blamed_on_the_model() -> None:
    from pytest_gpuregress.comparison.observations import model_code_cause

    reference, run = moe_record(False, "5.24.0"), moe_record(False, "4.57.6")
    run.fingerprint["device"] = {"blas_library": "cublasLt 12.9"}  # a kernel library moved too
    assert model_code_cause(reference, run) == ""


def tied_record(head: bool) -> RunRecord:
    """The tied model's record: one embedding tensor, or (``head``) the output head as a tensor of its own."""
    record = moe_record(False, "5.24.0")
    record.arrays["step0_grad/model.embed_tokens.weight"] = np.full((16, 8), 0.2, dtype=np.float32)
    if head:
        record.arrays["step0_grad/lm_head.weight"] = np.full((16, 8), 0.3, dtype=np.float32)
        record.series = {"loss": [5.7, 5.2]}
    return record


def test_a_head_untied_against_the_config_is_the_librarys_and_never_a_re_record() -> None:
    from pytest_gpuregress.comparison.report import format_comparison

    comparison = compare_named(tied_record(False), tied_record(True), lane="exact", tied=True)
    first = comparison.findings[0]
    assert (first.metric, first.component) == ("model", "library: transformers")
    assert first.facts == {"built_by": "transformers"}
    assert first.message.startswith("the model's config ties the input and output")
    assert "(tie_word_embeddings: true)" in first.message and "lm_head.weight as a tensor of its own" in first.message
    assert {f.component for f in comparison.findings} == {"library: transformers"}
    text = format_comparison(comparison, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="REF",
                             record_hint="OVERWRITE", record_elsewhere_hint="ELSEWHERE")
    assert "record nothing" in text and "OVERWRITE" not in text and "ELSEWHERE" not in text
    convict(comparison, "collective", "equivalence")  # experiments convicting a fault keep the tie's own name
    assert comparison.findings[0].component == "library: transformers"


def test_a_tie_the_config_does_not_ask_for_or_a_run_that_follows_its_config_keeps_the_model_verdict() -> None:
    untied_config = compare_named(tied_record(False), tied_record(True), lane="exact", tied=False)
    assert untied_config.findings[0].component == model_layout.METRIC  # the run follows its config: the layout
    unknown = compare_named(tied_record(False), tied_record(True), lane="exact", tied=None)
    assert unknown.findings[0].component == model_layout.METRIC  # a factory's model: no config to judge by
    retied = compare_named(tied_record(True), tied_record(False), lane="exact", tied=False)
    assert retied.findings[0].component == "library: transformers"
    assert "does not tie" in retied.findings[0].message and "sharing model.embed_tokens.weight's tensor" in \
        retied.findings[0].message


def test_one_missing_gradient_or_a_new_parameter_is_no_tie() -> None:
    reference, run = tied_record(False), tied_record(False)
    del run.arrays[f"step0_grad/{FUSED}"]  # a stack fault left a parameter without its gradient
    assert model_layout.tie_built_otherwise(reference, run, tied=False) is None
    assert model_layout.tie_built_otherwise(reference, run, tied=True) is None
    grown = tied_record(False)
    grown.arrays["step0_grad/model.layers.0.mlp.gate.weight"] = np.full((4, 8), 0.1, dtype=np.float32)
    assert model_layout.tie_built_otherwise(reference, grown, tied=True) is None  # not the head: the model's code


def test_the_tie_names_the_model_library_that_changed() -> None:
    run = tied_record(True)
    run.fingerprint["versions"]["torch"] = "2.14.1"
    library, message = model_layout.tie_built_otherwise(tied_record(False), run, tied=True)
    assert library == "torch" and "(torch 2.13.0 -> 2.14.1)" in message
