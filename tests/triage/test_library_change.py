"""Library code that computes another function is named ``[library: <package>]``, never a kernel, and carries no
advice to re-record over the reference (#34 item 4): the float64 oracle's step 0, kept with the reference, moves
only when the model's code changed (evidence/oracle_step0.py). The faults that emulate it replace the library's
own functions (faults/library.py) and run in the oracle's launch too, as installed code would.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.comparison.compare import Comparison, Finding
from pytest_gpuregress.comparison.report import format_comparison
from pytest_gpuregress.evidence import data_change, oracle_step0
from pytest_gpuregress.evidence.first_moved import FirstMoved
from pytest_gpuregress.evidence.op_trace import TraceOp
from pytest_gpuregress.faults import KINDS, parse
from pytest_gpuregress.faults.reach import installed_code
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import Launch
from pytest_gpuregress.triage import model_code
from pytest_gpuregress.triage.naming import op_component

from ..conftest import make_record

LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


def oracle(lora_b_scale: float = 1.0, noise: float = 0.0, loss: float = 5.5) -> RunRecord:
    """A float64 oracle's record: its step-0 loss and two gradients."""
    record = make_record()
    rng = np.random.default_rng(0)
    record.arrays = {"step0_grad/" + Q_PROJ: rng.normal(size=(8, 8)) * (1 + noise),
                     "step0_grad/" + LORA_B: rng.normal(size=(8, 2)) * lora_b_scale}
    record.series = {"loss": [loss, loss * 0.9]}
    record.results = {oracle_step0.MODE_KEY: {"mode": "float64 throughout", "not_float64": []}}
    return record


def kept(record: RunRecord, with_oracle: RunRecord) -> RunRecord:
    oracle_step0.attach(record, with_oracle)
    return record


def test_a_float64_oracle_that_moves_only_by_rounding_is_no_code_change() -> None:
    reference = kept(make_record(), oracle())
    assert oracle_step0.code_change(reference, oracle()) is None
    assert oracle_step0.code_change(reference, oracle(noise=1e-12)) is None  # another float64 kernel path
    assert oracle_step0.code_change(make_record(), oracle(lora_b_scale=2.0)) is None  # recorded before: no verdict


def test_a_scaled_adapter_is_a_code_change_of_peft_and_a_moved_loss_of_the_model() -> None:
    reference = kept(make_record(), oracle())
    change = oracle_step0.code_change(reference, oracle(lora_b_scale=8 ** 0.5))  # alpha / sqrt(r) for alpha / r, r=8
    assert change is not None and change.tensor == LORA_B and change.moved == 1 and change.total == 2
    assert change.relative == pytest.approx(8 ** 0.5 - 1, rel=1e-9)
    assert "the code computes another function" in change.describe()
    rope = oracle_step0.code_change(reference, oracle(noise=1e-3, loss=5.6))
    assert rope is not None and rope.tensor == "loss"
    renamed = make_record()
    renamed.arrays = {"step0_grad/other": np.ones(3)}
    assert oracle_step0.code_change(reference, renamed) is None  # another layout: evidence/model_layout.py's


def moved_at(tensor: str, loss_relative: float = 0.0) -> oracle_step0.CodeChange:
    return oracle_step0.CodeChange(tensor, 0.5, 1, 2, loss_relative)


def test_the_package_is_the_one_that_changed_else_the_one_whose_code_runs_where_the_oracle_moved() -> None:
    same = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.16.0"}
    """Where the step-0 trace says nothing of which code moved: by the gradients that moved, a version breaking the tie."""
    assert model_code.suspect(moved_at(LORA_B), same, same)[0] == "library: peft"
    # lora's oracle keeps adapter gradients only: where its loss moved too, the model's forward changed
    assert model_code.suspect(moved_at(LORA_B, loss_relative=0.02), same, same)[0] == "library: transformers"
    package, why = model_code.suspect(moved_at(Q_PROJ), same, same)
    assert package == "library: transformers" and "on this machine was changed or patched" in why
    newer = {**same, "transformers": "5.25.0"}
    package, why = model_code.suspect(moved_at(LORA_B), same, newer)  # peft did not change; transformers did
    assert package == "library: transformers" and why.startswith("transformers changed since")
    assert "(5.24.0 -> 5.25.0)" in why
    assert model_code.suspect(moved_at(Q_PROJ), same, {**same, "torch": "2.14.1"})[0] == "library: torch"
    package, why = model_code.suspect(moved_at(LORA_B), same, {**same, "peft": "0.22.0", "torch": "2.14.1"})
    assert package == "library: peft" and why.endswith("(torch changed too: 2.13.0 -> 2.14.1)")
    # accelerate only wraps the training runs; the float64 oracle never runs it
    assert model_code.suspect(moved_at(Q_PROJ), same, {**same, "accelerate": "1.17.0"})[0] == "library: transformers"


def traced_op(op: str, module: str, phase: str, arguments: str, package: str) -> TraceOp:
    return TraceOp(7, op, module, "", phase, "f32[16, 64]", ("f32[16, 64]",), np.zeros((1, 3)), np.zeros(1),
                   arguments=arguments, package=package)


def test_what_moved_outranks_any_version_number() -> None:
    """#46: the helper's peft bug on the newest releases was named transformers because transformers' version had
    changed. The op that introduced the difference says whose code it was: called with other arguments, its
    caller's package; the same inputs and arguments giving another answer, a kernel; ops inserted or replaced, the
    package whose code runs them. Versions decide only where none of these is known."""
    same = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2"}
    newer = {**same, "transformers": "5.25.0"}
    scale = "aten::mul"
    called_otherwise = FirstMoved(0, "moved", traced_op(scale, "q_proj", "backward", "other=0.3535533905932738", "peft"),
                                  traced_op(scale, "q_proj", "backward", "other=0.5", "peft"), 10, 0.4, 2)
    component, why = model_code.suspect(moved_at(LORA_B), same, newer, called_otherwise)
    then, now = called_otherwise.reference.arguments, called_otherwise.entry.arguments
    assert (then, now) == ("other=0.5", "other=0.3535533905932738")
    assert component == "library: peft" and f"{then} in the reference, {now} now" in why
    assert "peft's code calls it otherwise" in why
    kernel = FirstMoved(0, "moved", traced_op("aten::mm", "q_proj", "forward", "", "torch"),
                        traced_op("aten::mm", "q_proj", "forward", "", "torch"), 10, 1e-4, 2)
    component, why = model_code.suspect(moved_at(Q_PROJ), same, newer, kernel)
    assert component == "kernel" and "another function, in float64 too" in why
    component, why = model_code.suspect(moved_at(Q_PROJ), same, same, None, ["kernels", "transformers"])
    assert component == "library: kernels" and "also in transformers" in why
    # an optimizer op called otherwise is the optimizer's, whoever's code that is
    adamw = FirstMoved(0, "moved", traced_op("aten::_foreach_mul_", "w", "optimizer", "scalar=0.9", "torch"),
                       traced_op("aten::_foreach_mul_", "w", "optimizer", "scalar=0.99", "torch"), 10, 1e-4, 2)
    assert adamw.arguments_changed and op_component(adamw) == "optimizer"
    # traces recorded before arguments were kept say nothing of them
    older = FirstMoved(0, "moved", traced_op(scale, "q_proj", "backward", "other=0.35", "peft"),
                       TraceOp(7, scale, "q_proj", "", "backward", "f32[16, 64]", ("f32[16, 64]",), np.zeros((1, 3)),
                               np.zeros(1)), 10, 0.4, 2)
    assert not older.arguments_changed and op_component(older) == "kernel"


def test_a_nan_oracle_loss_on_one_side_is_a_change_and_never_hides_the_gradients() -> None:
    reference = kept(make_record(), oracle())
    broken = oracle(lora_b_scale=2.0, loss=float("nan"))
    change = oracle_step0.code_change(reference, broken)
    assert change is not None and change.tensor == "loss" and change.relative == float("inf")


def test_the_failure_is_explained_by_the_library_from_the_oracle_launch_it_runs() -> None:
    launch = Launch("triage-oracle", {})
    scenario = SimpleNamespace(oracle_launch=lambda setup, model: launch, triage=None)
    reference = kept(make_record(), oracle())
    from importlib import metadata

    reference.fingerprint = {"versions": {p: metadata.version(p) for p in ("torch", "transformers", "peft")}}
    ran: list[str] = []

    def runner(changed: RunRecord) -> Any:
        return lambda sc, la: ran.append(la.key) or changed

    found = model_code.experiment(scenario, SimpleNamespace(), runner(oracle(lora_b_scale=2.0)), reference, None)  # type: ignore[arg-type]
    assert found is not None and ran == ["triage-oracle"]
    component, evidence = found.component, found.detail
    assert component == "library: peft"
    assert evidence.startswith("the float64 oracle's step 0 on this stack differs")
    assert "peft is at the reference's version" in evidence  # no version changed: the code on this machine did
    assert model_code.experiment(scenario, SimpleNamespace(), runner(oracle()), reference, None) is None  # type: ignore[arg-type]
    no_oracle = SimpleNamespace(oracle_launch=lambda setup, model: None, triage=None)
    assert model_code.experiment(no_oracle, SimpleNamespace(), runner(oracle(2.0)), reference, None) is None  # type: ignore[arg-type]
    # A reference whose oracle was computed another way is no evidence on the code: the move would be the oracle's.
    other = kept(make_record(), oracle())
    other.results[oracle_step0.RESULT_KEY]["mode"] = {"mode": "float64 with the model's own casts"}
    ran.clear()
    assert model_code.experiment(scenario, SimpleNamespace(), runner(oracle(2.0)), other, None) is None  # type: ignore[arg-type]
    assert ran == []


def test_the_float64_oracle_is_float64_throughout_and_says_so() -> None:
    """#46 item 9: transformers' LlamaRMSNorm computes in float32 (``.to(torch.float32)``) and its RoPE angles with
    ``.float()``: the oracle turns those into float64 and lists any op that still was not."""
    import torch

    from pytest_gpuregress.training.models import blueprint, build_causal_lm
    from pytest_gpuregress.training.moe import in_float64
    from pytest_gpuregress.training.oracle import float64_throughout

    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    def step0(throughout: bool) -> float:
        model = in_float64(build_causal_lm(blueprint({"model": "tiny-llama", "model_size": "cpu", "dtype": "fp32"}), seed=0))
        with float64_throughout() if throughout else contextlib.nullcontext() as watching:
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
        assert watching is None or watching.not_float64 == []  # every floating output float64
        return float(loss.detach())

    casts_kept, throughout = step0(False), step0(True)
    assert 0 < abs(throughout - casts_kept) / casts_kept < 1e-7  # the model's own float32 norms: a small move


def test_a_library_finding_gives_release_notes_and_a_folder_of_its_own_never_a_re_record() -> None:
    finding = Finding("step0_grad", "step0_grad model.layers.0.self_attn.q_proj.weight ...", component="library: transformers")
    comparison = Comparison("tolerant", "the stack changed", [finding], [])
    text = format_comparison(comparison, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="ref",
                             record_hint="pytest --gpuregress --gpuregress-record -k fsdp",
                             record_elsewhere_hint="pytest --gpuregress --gpuregress-record -k fsdp "
                                                   "--gpuregress-reference-dir=new")
    assert "[library: transformers] step0_grad" in text
    assert "code changed with transformers" in text and "transformers: check its release notes" in text
    assert "--gpuregress-reference-dir=new" in text and "record them as the reference" not in text


def test_library_faults_are_installed_code_that_runs_in_the_oracle_too() -> None:
    assert KINDS["library"].installed_code and not KINDS["linear_noise"].installed_code
    texts = ["library:mode=rope_interleaved", "linear_noise:rel=1e-4"]
    assert installed_code(texts) == ["library:mode=rope_interleaved"]
    assert installed_code(["collective:op=reduce_scatter"]) == []


def test_the_rope_fault_replaces_transformers_rotate_half_and_undoes_it() -> None:
    import torch
    from transformers.models.llama import modeling_llama

    from pytest_gpuregress.faults.library import install

    original = modeling_llama.rotate_half
    ctx = SimpleNamespace(cleanup_hooks=[])
    firing = install(parse("library:mode=rope_interleaved"), ctx)
    x = torch.arange(8.0).reshape(1, 8)
    assert torch.equal(modeling_llama.rotate_half(x), torch.tensor([[-1.0, 0, -3, 2, -5, 4, -7, 6]]))
    assert firing.count == 1
    for undo in ctx.cleanup_hooks:
        undo()
    assert modeling_llama.rotate_half is original
    assert torch.equal(original(x), torch.tensor([[-4.0, -5, -6, -7, 0, 1, 2, 3]]))


def test_the_rslora_fault_scales_peft_adapters_by_alpha_over_the_root_of_r_and_undoes_it() -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer

    from pytest_gpuregress.faults.library import install

    def adapted() -> Any:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))

    original = LoraLayer.update_layer
    ctx = SimpleNamespace(cleanup_hooks=[])
    firing = install(parse("library:mode=lora_rslora"), ctx)
    layer = next(m for m in adapted().modules() if isinstance(m, LoraLayer))
    assert layer.scaling["default"] == pytest.approx(8 / 4 ** 0.5) and firing.count == 1
    for undo in ctx.cleanup_hooks:
        undo()
    assert LoraLayer.update_layer is original
    layer = next(m for m in adapted().modules() if isinstance(m, LoraLayer))
    assert layer.scaling["default"] == pytest.approx(8 / 4)


def test_an_experiment_that_convicts_this_stack_wins_over_a_library_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgrade that changed transformers and broke a collective: equivalence convicts the collective, and the
    library's change is evidence beside it, never a verdict that buries the bug under "record your own"."""
    from pytest_gpuregress import triage
    from pytest_gpuregress.triage import explain

    evidence = "the float64 oracle's step 0 on this stack differs ..."
    monkeypatch.setattr(model_code, "experiment", lambda *args: triage.Experiment(
        "model code", "differs", evidence, component="library: transformers"))
    finding = Finding("step0_grad", "step0_grad ...", step=0, component="kernel")

    def explained(experiments: list[Any], run_experiments: bool = True,
                  findings: list[Finding] | None = None) -> tuple[Any, list[str]]:
        monkeypatch.setattr(explain, "cheap_evidence", lambda *args: list(experiments))
        comparison = Comparison("tolerant", "changed", findings or [finding], [])
        found = explain.explain_failure(SimpleNamespace(), SimpleNamespace(), None, make_record(), comparison,  # type: ignore[arg-type]
                                        None, flips=False, run_experiments=run_experiments)
        return (found.verdict.component if found.verdict else None), found.lines

    convicting = [triage.Experiment("equivalence", "differs", "2 ranks differ from 1", component="collective"),
                  triage.Experiment("oracle", "clean", "")]
    component, lines = explained(convicting)
    assert component == "collective" and f"model code differs: {evidence}" in lines[1]  # evidence beside the verdict
    clean = [triage.Experiment("equivalence", "clean", ""), triage.Experiment("oracle", "clean", "")]
    component, lines = explained(clean)
    assert component == "library: transformers" and lines[1].startswith("triage verdict: library: transformers. ")
    assert f"model code differs: {evidence}" in lines[1] and "Decided by rule model-code (" in lines[1]
    # a scenario triage does not explain: a round trip's finding keeps its name, the code change is evidence
    round_trip = Finding("resume", "resume ...", component="checkpoint")
    component, lines = explained([], run_experiments=False, findings=[round_trip])
    assert component is None and lines == ["", f"also: {evidence}"]
    component, lines = explained([], run_experiments=False)
    assert component == "library: transformers"


def test_every_built_in_training_scenario_has_a_float64_oracle_for_the_library_check() -> None:
    """lora brings its own oracle (the base model with its adapter); fsdp's is triage's. Without one a library
    release that changes the math could only be called a kernel."""
    from pytest_gpuregress.scenarios import Setup, registry
    from pytest_gpuregress.triage.model_code import oracle_launch

    setup = Setup(device_kind="cpu", backend="gloo", world_size=2)
    for name in ("fsdp", "lora"):
        launch = oracle_launch(registry()[name], setup, None)
        assert launch is not None, name
    assert oracle_launch(registry()["collectives"], setup, None) is None  # a check scenario has none


def test_a_view_with_other_strides_alone_is_no_call_with_other_arguments() -> None:
    """An upstream kernel or backend that returns another layout (a transposed attention output) hands the next op
    a view with other strides: that op is not 'called otherwise', and the verdict stays with the kernel. A view
    that starts elsewhere in its storage (the odd features instead of the second half) is the caller's slicing."""
    def moved(now: str, then: str) -> FirstMoved:
        return FirstMoved(0, "moved", traced_op("aten::neg", "rotary", "forward", now, "transformers"),
                          traced_op("aten::neg", "rotary", "forward", then, "transformers"), 10, 1e-4, 2)

    restrided = moved("self@0:[64, 1, 2048]", "")
    assert not restrided.arguments_changed and op_component(restrided) == "kernel"
    assert not moved("self@4:[8, 1], alpha=2", "self@4:[1, 8], alpha=2").arguments_changed
    sliced = moved("self@1:[64, 2]", "self@32:[64, 1]")
    assert sliced.arguments_changed and op_component(sliced) == "library: transformers"
    assert moved("alpha=3", "alpha=2").arguments_changed


def test_a_bf16_run_whose_kept_oracle_moved_fails_though_its_own_limits_pass() -> None:
    """A kernel computing another function computes it in float64 too: the run is no further from this stack's oracle
    than the reference from its own, and bf16's wide limits pass. The oracle kept with the run against the one kept
    with the reference fails it (rule oracle-moved); an oracle that moved by rounding, or another oracle, does not."""
    from pytest_gpuregress.comparison.compare import compare_training
    from pytest_gpuregress.triage.naming import name_findings

    reference = kept(make_record(), oracle())
    same_run = kept(make_record(), oracle(noise=1e-12))
    clean = compare_training(reference, same_run)
    assert clean.findings == [] and oracle_step0.METRIC not in clean.margins
    moved = name_findings(compare_training(reference, kept(make_record(), oracle(noise=1e-3))))
    [finding] = moved.findings
    assert (finding.metric, finding.step, finding.tensor) == (oracle_step0.METRIC, 0, Q_PROJ)
    assert (finding.component, finding.rule) == ("kernel or library", "oracle-moved")
    assert finding.distance == pytest.approx(1e-3, rel=1e-6) and finding.tolerance == oracle_step0.CODE_CHANGE
    assert moved.margins[oracle_step0.METRIC] == pytest.approx(1e3, rel=1e-6)
    other_mode = kept(make_record(), oracle(noise=1e-3))
    other_mode.results[oracle_step0.RESULT_KEY]["mode"] = {"mode": "lora adapters", "not_float64": []}
    assert compare_training(reference, other_mode).findings == []  # another oracle: not comparable
    escaped = kept(make_record(), oracle(noise=1e-3))  # an op that escaped float64 now: the code's change, judged
    escaped.results[oracle_step0.RESULT_KEY]["mode"] = {"mode": "float64 throughout", "not_float64": ["aten::mm"]}
    assert [f.metric for f in compare_training(reference, escaped).findings] == [oracle_step0.METRIC]
    other_data = kept(make_record(), oracle(noise=1e-3))  # other token batches move the oracle too: data says so
    other_data.series[data_change.BATCH_DIGEST] = [1.0] * 5
    other_data_reference = kept(make_record(), oracle())
    other_data_reference.series[data_change.BATCH_DIGEST] = [2.0] * 5
    assert [f.metric for f in compare_training(other_data_reference, other_data).findings] == ["data"]
    assert compare_training(make_record(), kept(make_record(), oracle(noise=1e-3))).findings == []  # none kept


def test_a_continuation_is_judged_by_the_oracle_kept_with_the_whole_reference() -> None:
    """A resume case compares with the reference from its checkpoint's step on, which keeps no results: the oracle
    kept with the whole reference still convicts the model's code (rule model-code), not 'inconclusive'."""
    from pytest_gpuregress.triage.explain import explain_failure

    from ..conftest import compare_named

    launch = Launch("triage-oracle", {})
    scenario = SimpleNamespace(oracle_launch=lambda setup, model: launch, triage=None)
    whole = kept(make_record(), oracle())
    continuation = make_record()  # as comparison/continuation.py gives it: results dropped
    moved = make_record()
    moved.series["loss"] = [x * 1.01 for x in moved.series["loss"]]
    comparison = compare_named(continuation, moved, lane="tolerant")
    assert comparison.findings and not continuation.results

    def explained(whole_reference: RunRecord | None) -> Any:
        return explain_failure(scenario, SimpleNamespace(), lambda sc, la: oracle(noise=1e-3), continuation,  # type: ignore[arg-type]
                               comparison, None, flips=False, run_experiments=False, whole_reference=whole_reference)

    assert explained(whole).verdict.rule == "model-code"
    assert explained(None).verdict.rule != "model-code"  # the continuation alone keeps no oracle to judge against
