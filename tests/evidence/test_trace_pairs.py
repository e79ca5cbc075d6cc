"""A real upgrade changes more than numbers (#45): the step-0 traces are paired across a changed op sequence, an
unregistered module is labelled from where it ran, and one wrong element shows through another kernel path's drift.

In-process: the tiny Llama's step 0 traced on one rank (tests/evidence/test_op_trace.py). The upgrade transformers 5.25
brought, `kernels` running RoPE in a `Func` module the model does not register, is emulated by wrapping
transformers' own ``apply_rotary_pos_emb`` in such a module; drift by every linear layer's output off by 1e-7.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.evidence import introduced
from pytest_gpuregress.evidence.op_trace import ranks
from pytest_gpuregress.evidence.trace_pairs import folded, pair
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.triage.naming import op_component

from ..conftest import compare_named
from .test_introduced import report
from .test_op_trace import UP_PROJ, traced_step0

DRIFT = "linear_noise:rel=1e-7"  # another kernel path: every GEMM's output an ulp or so away


@pytest.fixture(scope="module")
def reference() -> RunRecord:
    record = traced_step0()
    introduced.attach_thresholds(record.results)
    return record


class _Wrapped:
    """transformers' RoPE run inside a module of its own that the model does not register, as `kernels` runs a
    hub kernel's function (a new ``Func`` at every call)."""

    def __init__(self) -> None:
        import torch
        from transformers.models.llama import modeling_llama

        self.module, self.original = modeling_llama, modeling_llama.apply_rotary_pos_emb
        original = self.original

        class Func(torch.nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return original(*args, **kwargs)

        def through_a_module(*args: Any, **kwargs: Any) -> Any:
            return Func()(*args, **kwargs)

        modeling_llama.apply_rotary_pos_emb = through_a_module

    def remove(self) -> None:
        self.module.apply_rotary_pos_emb = self.original


def upgraded(*faults: str) -> RunRecord:
    """Step 0 with RoPE in an unregistered module and ``faults``, its later losses off so that the run fails."""
    record = traced_step0(faults=faults, hook=lambda model: _Wrapped())
    record.series = {k: [vals[0], *(v * (1 + 1e-3) for v in vals[1:])] for k, vals in record.series.items()}
    return record


def test_an_unregistered_module_is_labelled_from_where_it_ran(reference: RunRecord) -> None:
    trace = ranks(upgraded())[0]
    modules = {trace.entry(i).module for i in range(len(trace))}
    assert "model.layers.0.self_attn.<Func>" in modules and "Func" not in modules
    assert folded("model.layers.12.self_attn.<Func>") == "model.layers.N.self_attn.<Func>"


def test_a_wrapper_module_is_one_note_and_the_ops_past_it_are_still_paired(reference: RunRecord) -> None:
    run = upgraded(DRIFT)
    ref_trace, run_trace = ranks(reference)[0], ranks(run)[0]
    pairing = pair(ref_trace, run_trace)
    assert pairing.unpaired == 0 and len(pairing.pairs) == len(run_trace)  # every op found its partner
    comparison = compare_named(reference, run, lane="tolerant")
    assert comparison.sequence_notes == [
        f"{len(pairing.relabelled)} ops now run in `model.layers.N.self_attn.<Func>` (`model.layers.N.self_attn` in "
        "the reference)"]
    assert comparison.culprit is None  # drift only: no op is named, past the wrapper either
    assert comparison.changed_code == []  # relabelled, not changed: no package's code runs other ops
    assert comparison.new_dtypes == []  # and nothing computes in another precision
    text = report(comparison)
    assert "introduced at: no op of step 0" in text
    assert "op sequence changed since the reference" in text


class _Autocast:
    """The model's forward run under an autocast to bfloat16, set on the instance as a library that prepares a model
    for mixed precision sets it."""

    def __init__(self, model: Any) -> None:
        import types

        import torch

        plain = model.forward

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                return plain(*args, **kwargs)
        model.forward = types.MethodType(forward, model)
        self.model = model

    def remove(self) -> None:
        del self.model.forward


def test_an_autocast_a_library_set_on_the_model_is_another_precision_not_a_kernel(reference: RunRecord) -> None:
    """#53: an fp32 model run under an autocast inserts casts everywhere and computes its matmuls in bf16, which no
    op of the reference did: the library that prepared the model, not the kernels whose composition changed."""
    from pytest_gpuregress.triage import verdict

    run = traced_step0(hook=_Autocast)
    run.series = {k: [v * (1 + 1e-3) for v in vals] for k, vals in run.series.items()}
    comparison = compare_named(reference, run, lane="tolerant")
    assert comparison.new_dtypes == ["bf16"], comparison.sequence_notes
    found = verdict(comparison, [])
    assert (found.component, found.rule) == ("library", "other-precision"), found.line
    assert "now compute in bf16" in found.quoted


def test_past_the_wrapper_a_gemm_error_is_introduced_at_its_matmul(reference: RunRecord) -> None:
    comparison = compare_named(reference, upgraded(DRIFT, "linear_noise:rel=1e-4,features=176"), lane="tolerant")
    culprit = comparison.culprit
    assert culprit is not None and culprit.entry is not None, report(comparison)
    assert (culprit.entry.op, culprit.entry.phase, op_component(culprit)) == ("aten::mm", "forward", "kernel")
    assert culprit.entry.module == UP_PROJ.replace("up_proj", "gate_proj")  # the first 176-wide projection
    assert comparison.sequence_notes and "<Func>" in comparison.sequence_notes[0]


@pytest.mark.parametrize("rel", [1e-3, 1e-4])
def test_one_wrong_element_of_a_gemm_is_introduced_at_its_matmul_through_drift(reference: RunRecord, rel: float) -> None:
    """One element of each 176-wide projection's output off by ``rel``: the output's digests move like drift (1e-8
    relative and less), its sketch shows one bucket far past the others, which no input of it had."""
    comparison = compare_named(reference, upgraded(DRIFT, f"linear_noise:rel={rel},features=176,elements=last"),
                                  lane="tolerant")
    culprit = comparison.culprit
    assert culprit is not None and culprit.entry is not None and culprit.spike is not None, report(comparison)
    assert (culprit.entry.op, culprit.entry.module, culprit.entry.phase) == \
        ("aten::mm", UP_PROJ.replace("up_proj", "gate_proj"), "forward")
    assert culprit.relative < 1e-7 and culprit.spike[0] >= introduced.DEFAULT.spike_floor_ulps
    said = report(comparison)
    assert "a few of its output's elements moved" in said and "one bucket of its sketch" in said
    assert f"sketch by {culprit.spike[0]:.3g} ulps" in said


def test_a_one_token_gradient_change_propagating_through_a_gemm_is_not_pinned_on_it(reference: RunRecord) -> None:
    """A row a GEMM reads that moved (one token's gradient) makes a row of its output move: many buckets, not a
    few, so the sketch names no op for it (tests/evidence/test_introduced.py: one gradient element off by 1e-3)."""
    run = upgraded(DRIFT)
    assert compare_named(reference, run, lane="tolerant").culprit is None


def test_sums_over_parameters_registered_in_another_order_are_the_models_code_not_the_clip() -> None:
    """A fresh-eyes change: transformers registering a layer's submodules in another order moves the clip's total
    norm (a sum in registration order) by an ulp in the exact lane, and the training after it. That is the model's
    code, never the clip or the update; step 0's gradients are bitwise the reference's."""
    from pytest_gpuregress.triage import verdict

    from ..conftest import make_record

    reference = make_record(steps=6)
    reference.series["clipped_grad_norm"] = [0.5] * 6
    run = make_record(steps=6)
    run.param_names = list(reversed(reference.param_names))
    run.arrays = {**run.arrays, "param_grad_norm": reference.arrays["param_grad_norm"][:, ::-1].copy()}
    run.series["clipped_grad_norm"] = [0.5, float(np.nextafter(0.5, 1.0)), 0.5, 0.5, 0.5, 0.5]
    run.series["loss"] = [*run.series["loss"][:3], *(v * (1 + 1e-6) for v in run.series["loss"][3:])]
    comparison = compare_named(reference, run, lane="exact")
    assert comparison.reordered and {(f.component, f.rule) for f in comparison.findings} == {
        ("model", "registration-order")}
    assert all("the clipping itself scaled them wrongly" not in f.message for f in comparison.findings)
    found = verdict(comparison, [])
    assert (found.component, found.rule) == ("model", "registration-order")


def test_a_layer_that_registers_its_submodules_in_another_order_is_compared_by_name() -> None:
    """Same names, same shapes, same numbers, another registration order (a refactor): the per-parameter series
    are paired by name, so the run passes, with a note; by position it failed at 2.4e7x its limit."""
    import numpy as np

    from pytest_gpuregress.comparison.envelope import deviations
    from pytest_gpuregress.reference import by_name

    from ..conftest import make_record

    reference = make_record(steps=6)
    run = make_record(steps=6)
    run.param_names = list(reversed(reference.param_names))
    run.arrays = {**run.arrays, "param_grad_norm": reference.arrays["param_grad_norm"][:, ::-1].copy()}
    comparison = compare_named(reference, run, lane="tolerant")
    assert comparison.passed and comparison.notes == [by_name.REORDERED]
    assert comparison.margins["param_grad_norm"] == 0.0
    assert deviations(reference, run)["param_grad_norm"].max() == 0.0  # the envelope pairs them by name too
    assert "  note: this run registers the model's parameters in another order" in report(comparison)
    # Other names are no reordering: the series stay as they are, and the layout's own finding speaks.
    renamed = make_record(steps=6)
    renamed.param_names = ["x.weight", "y.weight"]
    assert by_name.param_grad_norms(reference, renamed) == (renamed.arrays["param_grad_norm"], None)
    assert np.array_equal(by_name.param_grad_norms(reference, reference)[0], reference.arrays["param_grad_norm"])


def test_ops_inserted_or_replaced_name_the_package_whose_code_runs_them(reference: RunRecord) -> None:
    """A RoPE convention changed in transformers' code: other ops in the rotary step. The package named is the one
    whose code runs them (torch's own ops around them come last), which the moved float64 oracle then blames."""
    run = traced_step0(faults=("library:mode=rope_interleaved",))
    comparison = compare_named(reference, run, lane="tolerant")
    assert comparison.changed_code[:1] == ["transformers"], comparison.sequence_notes
    # In the exact lane the first op that moved is a negation that now reads the odd features of the same tensor:
    # equal input digests, another view of them. The view's offset and strides are among its arguments.
    exact = compare_named(reference, run, lane="exact").first_moved
    assert exact is not None and exact.arguments_changed and op_component(exact) == "library: transformers", \
        exact and exact.describe()
