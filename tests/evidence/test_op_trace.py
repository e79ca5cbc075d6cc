"""The step-0 op trace and the first op that moved (evidence/op_tracer.py, evidence/first_moved.py).

In-process: the tiny Llama's step 0 (forward, backward, clipping, AdamW) traced on one rank, clean and with a
fault of each kind; a kernel, an optimizer, a data and a code change are each named at the op where they first
give another answer. Two gloo ranks with FSDP2: a corrupted reduce-scatter is named at the collective, in the
backward of its layer. End to end through pytester (full tier): the failure report and the triage verdict.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.comparison.report import format_comparison, format_drift
from pytest_gpuregress.evidence.first_moved import first_moved
from pytest_gpuregress.evidence.op_trace import INPUT_OP, ranks
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.triage.naming import op_component

from ..conftest import FSDP_ONLY, FSDP_STEPS, compare_named, make_record

UP_PROJ = "model.layers.0.mlp.up_proj"
RS = "c10d::_reduce_scatter_base_"


def traced_step0(*, faults: tuple[str, ...] = (), backend: str = "auto", rank: int = 0, hook: Any = None,
                 tokens_changed: bool = False) -> RunRecord:
    """Step 0 of a fresh tiny Llama in this process, traced; ``faults`` installed around it, ``hook(model)`` may
    change the model first. A record holding the trace, as a rank's would."""
    import torch

    from pytest_gpuregress.evidence.op_tracer import OpTracer
    from pytest_gpuregress.faults import install_counted
    from pytest_gpuregress.training.models import blueprint, build_causal_lm
    from pytest_gpuregress.training.step import next_token_loss

    torch.set_num_threads(1)
    model = build_causal_lm(blueprint({"model": "tiny-llama", "model_size": "cpu", "dtype": "fp32"}), seed=0)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    if tokens_changed:
        tokens[0, 5] = (tokens[0, 5] + 1) % 256
    undo = hook(model) if hook is not None else None
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)
    ctx = SimpleNamespace(rank=rank, world_size=1, cleanup_hooks=[], config={})
    install_counted(list(faults), ctx)
    tracer = OpTracer(rank, model, backend=backend)
    try:
        with tracer.phase("forward"):
            loss = next_token_loss(model, tokens)
        with tracer.phase("backward"):
            loss.backward()
        with tracer.phase("clip"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        with tracer.phase("optimizer"):
            optimizer.step()
        tracer.finish()
    finally:
        for cleanup in reversed(ctx.cleanup_hooks):
            cleanup()
        if undo is not None:
            undo.remove()
    record = make_record()
    record.results, record.arrays = {}, dict(record.arrays)
    tracer.store(record.results, record.arrays)
    return record


@pytest.fixture(scope="module")
def clean() -> RunRecord:
    """A reference as the store keeps it: its trace with the thresholds it was recorded with."""
    from pytest_gpuregress.evidence.introduced import attach_thresholds

    record = traced_step0()
    attach_thresholds(record.results)
    return record


def gemm_error(rel: float) -> Any:
    """A float32 GEMM off by ``rel``: the matmul of ``UP_PROJ`` scales its output in place, as a faulty kernel
    would (in a fault region, like the project's faults: no op of the stack)."""
    import torch

    from pytest_gpuregress.training.kernels import fault_region

    def install(model: Any) -> Any:
        def scale(module: Any, args: Any, output: Any) -> None:
            with fault_region(), torch.no_grad():
                output.detach().mul_(1 + rel)

        return model.get_submodule(UP_PROJ).register_forward_hook(scale)

    return install


def test_the_hash_is_the_bits_of_the_tensor_and_sees_one_flipped_bit_or_two_swapped_elements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pytest_gpuregress.evidence import tensor_digest
    from pytest_gpuregress.evidence.tensor_digest import digest, numpy_hash, torch_digest

    monkeypatch.setattr(tensor_digest, "CHUNK", 300)  # the device path digests in chunks: here 4
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for tensor in (values, values.bfloat16(), values.double(), (values * 100).long(), values > 0):
        as_numpy = tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        # The device path (torch's int64 arithmetic, which wraps as the hash needs) and the CPU path agree.
        on_device = torch_digest(tensor)
        assert on_device[3] == numpy_hash(as_numpy) == digest(tensor)[3]
        assert on_device[:3] == pytest.approx(digest(tensor)[:3], rel=1e-12)
    total, abs_total, max_abs, hashed = digest(values)
    assert (total, abs_total, max_abs) == (float(values.double().sum()), float(values.double().abs().sum()),
                                           float(values.abs().max()))
    flipped = values.clone()
    flipped.view(torch.int32)[500] ^= 1
    swapped = values.clone()
    swapped[[3, 4]] = values[[4, 3]]
    assert digest(flipped)[3] != hashed and digest(swapped)[3] != hashed
    assert digest(swapped)[:3] == (total, abs_total, max_abs)  # the sums cannot see a swap; the hash does
    assert digest(values[::2])[3] == digest(values[::2].contiguous())[3]


def test_a_device_output_is_digested_only_after_every_stream_of_its_device_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP2 at world size 1 writes the reduce-scatter's output on its own stream; the digest reads on another. A
    # GPU tensor stands in here (this CPU build has no CUDA): the digest must synchronise its device first.
    import torch

    from pytest_gpuregress.evidence import op_tracer, tensor_digest

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"synchronize {device}"))
    monkeypatch.setattr(tensor_digest, "torch_digest", lambda tensor: events.append("read") or (0.0, 0.0, 0.0, 0))
    monkeypatch.setattr(tensor_digest, "torch_sketch", lambda tensor: events.append("sketch") or None)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 1), dtype=torch.bfloat16, is_floating_point=lambda: True,
                             is_complex=lambda: False, numel=lambda: 1 << 20)
    assert op_tracer._digest_of(on_gpu) == ((0.0, 0.0, 0.0, 0), None)
    assert events == ["synchronize cuda:1", "read", "sketch"]
    events.clear()
    tensor_digest.digest(torch.ones(4))  # a CPU tensor has no other stream to wait for
    assert events == []


def test_a_clean_rerun_reports_no_moved_op(clean: RunRecord) -> None:
    again = traced_step0()
    assert first_moved(clean, again) is None
    trace = ranks(again)[0]
    phases = {trace.entry(i).phase for i in range(len(trace))}
    assert phases == {"forward", "backward", "clip", "optimizer"} and len(trace) > 300
    # Tracing reads and never writes: the numbers of the traced step are the untraced step's.
    assert compare_named(clean, again, lane="exact").passed


def test_debug_mode_and_a_dispatch_mode_of_ours_trace_the_same_ops_and_digests(clean: RunRecord) -> None:
    from pytest_gpuregress.evidence.op_trace_modes import has_debug_mode

    if not has_debug_mode():
        pytest.skip("this torch has no torch.utils._debug_mode")
    ours = ranks(traced_step0(backend="TorchDispatchMode"))[0]
    theirs = ranks(traced_step0(backend="DebugMode"))[0]
    assert (ours.backend, theirs.backend) == ("TorchDispatchMode", "DebugMode")
    assert [ours.entry(i).identity for i in range(len(ours))] == [theirs.entry(i).identity for i in range(len(theirs))]
    assert np.array_equal(ours.hashes, theirs.hashes) and np.array_equal(ours.digests, theirs.digests)


def test_a_1e_4_error_in_a_float32_gemm_is_named_at_its_matmul_with_the_equal_ops_before_it(clean: RunRecord) -> None:
    moved = first_moved(clean, traced_step0(hook=gemm_error(1e-4)))
    assert moved is not None and moved.kind == "moved" and moved.entry is not None
    assert (moved.entry.op, moved.entry.module, moved.entry.phase) == ("aten::mm", UP_PROJ, "forward")
    assert moved.entry.inputs == "f32[128, 64] x f32[64, 176]" and moved.entry.outputs == ("f32[128, 176]",)
    assert moved.relative == pytest.approx(1e-4, rel=1e-2) and op_component(moved) == "kernel"
    trace = ranks(clean)[0]
    assert moved.equal_before == sum(trace.entry(i).op != INPUT_OP for i in range(moved.entry.index)) > 40
    assert moved.describe() == (
        f"first difference: aten::mm in {UP_PROJ} (forward), f32[128, 64] x f32[64, 176] -> f32[128, 176], "
        f"1.0e-04 relative; the {moved.equal_before} ops before it are bitwise equal (on rank 0 of 1, step-0 op trace)")


def test_the_linear_noise_fault_which_returns_a_new_tensor_is_named_at_the_first_matmul(clean: RunRecord) -> None:
    moved = first_moved(clean, traced_step0(faults=("linear_noise:rel=1e-4",)))
    assert moved is not None and moved.entry is not None
    assert (moved.entry.op, moved.entry.module, op_component(moved)) == \
        ("aten::mm", "model.layers.0.self_attn.q_proj", "kernel")


def test_an_optimizer_fault_is_named_at_the_optimizer(clean: RunRecord) -> None:
    moved = first_moved(clean, traced_step0(faults=("lr_scale:factor=1.01",)))
    assert moved is not None and moved.entry is not None
    assert moved.entry.phase == "optimizer" and op_component(moved) == "optimizer"
    assert moved.entry.module == "model.embed_tokens.weight"  # AdamW's first parameter: its decay uses the lr
    before = [ranks(clean)[0].entry(i) for i in range(moved.entry.index)]
    assert any(e.phase == "optimizer" for e in before)  # the optimizer's first ops (its step count) are equal


def other_epsilon(model: Any) -> Any:
    """A release that passes another epsilon to the first RMSNorm: no tensor changes, one scalar does."""
    norm = model.get_submodule("model.layers.0.input_layernorm")
    kept = norm.variance_epsilon
    norm.variance_epsilon = kept * 10
    return SimpleNamespace(remove=lambda: setattr(norm, "variance_epsilon", kept))


def test_each_op_keeps_its_scalar_arguments_and_the_package_whose_code_ran_it(clean: RunRecord) -> None:
    """#46 item 5: a library that calls an op otherwise (a divisor, a scale, an epsilon) moves no tensor input; the
    trace keeps the scalars each op was called with and whose code called it, so the op is named with its caller."""
    trace = ranks(clean)[0]
    entries = [trace.entry(i) for i in range(len(trace))]
    norm = next(e for e in entries if e.module == "model.layers.0.input_layernorm" and e.op == "aten::add")
    assert norm.arguments == "other=1e-05" and norm.package == "transformers"
    q_proj = next(e for e in entries if e.module == "model.layers.0.self_attn.q_proj" and e.op == "aten::mm")
    assert q_proj.package == "torch"  # nn.Linear's code
    assert {e.package for e in entries if e.phase == "optimizer" and e.op != INPUT_OP} == {"torch"}  # AdamW's, outside every module
    assert {e.package for e in entries if e.op == INPUT_OP} == {""}
    moved = first_moved(clean, traced_step0(hook=other_epsilon))
    assert moved is not None and moved.entry is not None and moved.arguments_changed
    assert (moved.entry.op, moved.entry.module) == ("aten::add", "model.layers.0.input_layernorm")
    assert op_component(moved) == "library: transformers"
    assert moved.reference is not None and (moved.reference.arguments, moved.entry.arguments) == \
        ("other=1e-05", "other=0.0001")
    assert (moved.site, moved.caller) == ("called otherwise", "transformers")
    said = moved.describe()  # the line names both calls and whose code made them
    assert f"{moved.reference.arguments} in the reference, {moved.entry.arguments} now" in said
    assert said.endswith("transformers's code calls it otherwise")


def test_changed_tokens_are_named_as_an_input_and_a_changed_op_sequence_as_such(clean: RunRecord) -> None:
    import torch

    moved = first_moved(clean, traced_step0(tokens_changed=True))
    assert moved is not None and moved.entry is not None
    assert (moved.entry.op, moved.entry.module, op_component(moved)) == (INPUT_OP, "model.embed_tokens", "data")

    def silu_by_hand(model: Any) -> Any:  # a library release that writes SiLU as x * sigmoid(x)
        act = model.get_submodule("model.layers.0.mlp.act_fn")
        return act.register_forward_hook(lambda module, args, out: args[0] * torch.sigmoid(args[0]))

    changed = first_moved(clean, traced_step0(hook=silu_by_hand))
    assert changed is not None and changed.kind == "sequence" and op_component(changed) is None
    assert changed.entry is not None and changed.entry.op == "aten::sigmoid"  # the reference read up_proj's weight
    assert "the op sequence changed at op" in changed.describe()


def test_the_report_names_the_op_and_triage_convicts_its_component(clean: RunRecord) -> None:
    from pytest_gpuregress import triage

    faulty = traced_step0(hook=gemm_error(1e-4))
    faulty.series = {k: [v * (1 + 1e-3) for v in vals] for k, vals in faulty.series.items()}
    comparison = compare_named(clean, faulty, lane="exact")
    assert not comparison.passed and comparison.first_moved is not None
    text = format_comparison(comparison, scenario="fsdp", platform_key="cpu-gloo-w2-fp32", reference_path="ref",
                             record_hint="record it")
    first = comparison.first_moved
    assert first.entry is not None and (first.label, first.entry.op, first.entry.module, first.entry.phase) == \
        ("first difference", "aten::mm", UP_PROJ, "forward")
    assert first.describe() in text
    clean_experiments = [triage.Experiment("equivalence", "clean", ""), triage.Experiment("oracle", "clean", "")]
    found = triage.verdict(comparison, clean_experiments)
    component, line = found.component, found.line
    culprit = comparison.culprit
    assert culprit is not None and culprit.entry is not None and (culprit.entry.op, culprit.entry.module) == \
        ("aten::mm", UP_PROJ)
    assert (component, found.rule) == ("kernel", "culprit-at-step0") and "first moved op differs: aten::mm in" in line
    lr_changed = traced_step0(faults=("lr_scale:factor=1.01",))
    lr_changed.series = {k: [vals[0], *(v * (1 + 1e-3) for v in vals[1:])] for k, vals in lr_changed.series.items()}
    optimizer = compare_named(clean, lr_changed, lane="exact")
    found = triage.verdict(optimizer, clean_experiments)
    component, line = found.component, found.line
    culprit = optimizer.culprit
    assert culprit is not None and culprit.entry is not None
    assert (culprit.entry.op, culprit.entry.module, culprit.entry.phase) == \
        ("aten::mul_", "model.embed_tokens.weight", "optimizer")
    assert (component, found.rule) == ("optimizer", "culprit-at-step0") and "first moved op differs: aten::mul_" in line


def test_a_tolerant_pass_with_moved_ops_says_where_bitwise_drift_starts(clean: RunRecord) -> None:
    drifted = traced_step0(hook=gemm_error(1e-7))
    comparison = compare_named(clean, drifted, lane="tolerant")
    assert comparison.passed
    assert format_drift(comparison) is not None and "aten::mm in model.layers.0.mlp.up_proj" in format_drift(comparison)
    same = format_drift(compare_named(clean, traced_step0(), lane="tolerant"))
    assert same is not None and same.startswith("no bitwise drift (information): all ")  # or that none did
    assert same.endswith("ops of step 0 equal the reference's on 1 rank")
    assert format_drift(compare_named(clean, traced_step0(), lane="exact")) is None  # bitwise anyway
    assert first_moved(make_record(), clean) is None  # a reference recorded before traces: nothing to say


def test_a_failure_of_the_tracer_stops_the_trace_and_never_the_training(clean: RunRecord,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpuregress.evidence import op_tracer

    def broken(tensor: Any) -> Any:
        raise ValueError("a digest that fails")

    monkeypatch.setattr(op_tracer, "digest_and_sketch", broken)
    record = traced_step0()  # the step ran to its end
    assert "ValueError: a digest that fails" in record.results["op_trace"]["ranks"]["0"]["error"]
    assert ranks(record) == {} and first_moved(clean, record) is None  # no evidence, and no false one


def _collective_rank(rank: int, world: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from pytest_gpuregress.evidence.op_tracer import OpTracer
    from pytest_gpuregress.faults import install_counted
    from pytest_gpuregress.training.fsdp2 import shard, shard_units
    from pytest_gpuregress.training.models import blueprint, build_causal_lm
    from pytest_gpuregress.training.step import next_token_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # Layers' reduce-scatters only (185 KB; the root's is 131 KB): the first in backward is the last layer's.
    for name, faults in (("clean", []), ("faulty", ["collective:op=reduce_scatter,min_bytes=150000,mode=nudge,rel=1e-3"])):
        model = build_causal_lm(blueprint({"model": "tiny-llama", "model_size": "cpu", "dtype": "fp32"}), seed=0)
        shard(shard_units(model))
        ctx = SimpleNamespace(rank=rank, world_size=world, cleanup_hooks=[], config={})
        install_counted(faults, ctx)
        tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(rank))
        tracer = OpTracer(rank, model)
        with tracer.phase("forward"):
            loss = next_token_loss(model, tokens)
        with tracer.phase("backward"):
            loss.backward()
        tracer.finish()
        for cleanup in ctx.cleanup_hooks:
            cleanup()
        record = make_record()
        record.results, record.arrays = {}, {}
        tracer.store(record.results, record.arrays)
        record.save(Path(out) / name / f"rank{rank}")
    dist.destroy_process_group()


@pytest.mark.full_tier  # two gloo ranks, about 10 s; the fast tier names a GEMM and an optimizer op in-process
def test_a_corrupted_reduce_scatter_is_named_at_the_collective_in_the_backward_of_its_layer(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from pytest_gpuregress.scenarios.base import Scenario

    mp.spawn(_collective_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    merged = {name: Scenario().merge([RunRecord.load(tmp_path / name / f"rank{r}") for r in range(2)])
              for name in ("clean", "faulty")}
    assert sorted(ranks(merged["faulty"])) == [0, 1]  # every rank's trace is kept
    moved = first_moved(merged["clean"], merged["faulty"])
    assert moved is not None and moved.entry is not None and op_component(moved) == "collective"
    assert (moved.entry.op, moved.entry.module, moved.entry.phase) == \
        ("c10d::_reduce_scatter_base_", "model.layers.1", "backward")
    assert (moved.rank, moved.also_on, moved.world) == (0, (1,), 2)
    region = f"FSDP::post_backward_reduce ({moved.entry.module})"
    assert moved.entry.region == region and f"(backward; {region})" in moved.describe()


@pytest.mark.full_tier
def test_end_to_end_the_failure_names_the_reduce_scatter_and_triage_keeps_its_stack(
        pytester: pytest.Pytester, fsdp_reference: Path) -> None:
    fault = "collective:op=reduce_scatter,min_bytes=100000,max_bytes=160000,mode=nudge,rel=1e-3"  # the root group's
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
                                f"--gpuregress-reference-dir={fsdp_reference}", "-k", FSDP_ONLY,
                                f"--gpuregress-inject={fault}", "--gpuregress-triage")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    first = next((line for line in out.splitlines() if f"first difference: {RS}" in line), "")
    assert " in the root module " in first, out[-6000:]
    assert "(backward; FSDP::post_backward_reduce)" in first
    assert "triage verdict: collective." in out and f"first moved op differs: {RS}" in out
    assert "its Python stack" in out and "_fsdp_collectives.py" in out
    assert os.sep in out  # file paths of the stack's frames


def test_legitimate_drift_at_step_0_convicts_nothing_when_the_failure_starts_later(clean: RunRecord) -> None:
    """Another kernel path moves an op of step 0 within the tolerance; an optimizer fault then fails step 1. The
    moved op is shown as drift, and the verdict is the optimizer's where the late window reproduced the divergence
    (step 0 matches), never that op's kernel."""
    from pytest_gpuregress import triage

    drifted = traced_step0(hook=gemm_error(1e-7))
    drifted.series = {k: [vals[0], *(v * (1 + 1e-3) for v in vals[1:])] for k, vals in drifted.series.items()}
    comparison = compare_named(clean, drifted, lane="tolerant")
    assert not comparison.passed and comparison.first_moved is not None
    experiments = [triage.Experiment("equivalence", "clean", ""), triage.Experiment("oracle", "clean", ""),
                   triage.Experiment("late window", "reproduced", "", component="optimizer")]
    found = triage.verdict(comparison, experiments)
    component, line = found.component, found.line
    assert component == "optimizer", line
    evidence = triage.first_moved_evidence(comparison)
    assert evidence is not None and evidence.status == "drift only" and not evidence.convicts
    drift = comparison.first_moved
    assert drift.entry is not None and (drift.entry.op, drift.entry.module) == ("aten::mm", UP_PROJ)
    assert drift.describe().removeprefix("first difference: ") in evidence.detail and evidence.detail in line
    assert found.rule == "late-window-reproduced"
    assert triage.verdict(comparison, experiments[:2]).component is None  # without the window: no kernel, no optimizer


def test_debug_mode_is_used_only_where_its_hooks_and_switches_are_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.10's DebugMode lacks switches 2.11 has; one without a pre-dispatch hook cannot serve the trace."""
    import types

    from pytest_gpuregress.evidence import op_trace_modes

    class Older:  # as torch 2.10 has it: no profiler-context or local-tensor switch
        def __init__(self, *, record_output: bool = True, record_stack_trace: bool = False) -> None: ...

        @staticmethod
        def dispatch_hooks(record_hook: object = None, log_hook: object = None, pre_log_hook: object = None) -> None: ...

    class NoPreHook(Older):
        @staticmethod
        def dispatch_hooks(record_hook: object = None, log_hook: object = None) -> None: ...  # type: ignore[override]

    assert op_trace_modes.debug_mode_switches(Older) == {"record_output": False}
    for found, usable in ((Older, True), (NoPreHook, False)):
        monkeypatch.setitem(__import__("sys").modules, "torch.utils._debug_mode", types.SimpleNamespace(DebugMode=found))
        assert op_trace_modes.has_debug_mode() is usable
    monkeypatch.undo()
    if op_trace_modes.has_debug_mode():  # this torch's own: every switch the tracer turns off is there
        from torch.utils._debug_mode import DebugMode

        assert set(op_trace_modes.debug_mode_switches(DebugMode)) == set(op_trace_modes._DEBUG_MODE_OFF)


def test_a_sketch_sums_interleaved_buckets_the_same_on_the_host_and_on_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """One wrong element moves one bucket by its whole error; a row or column that moved together spreads over
    every bucket (127 is prime); the device path (chunked) and the host path agree; small or integer outputs keep
    none."""
    import torch

    from pytest_gpuregress.evidence import tensor_digest
    from pytest_gpuregress.evidence.tensor_digest import SKETCH_BUCKETS, digest_and_sketch, torch_sketch

    values = torch.randn(128, 176, generator=torch.Generator().manual_seed(0))
    _, sketch = digest_and_sketch(values)
    flat = values.double().reshape(-1).numpy()
    assert sketch is not None and len(sketch) == SKETCH_BUCKETS
    assert np.allclose(sketch, [flat[b::SKETCH_BUCKETS].sum() for b in range(SKETCH_BUCKETS)], rtol=1e-12)
    monkeypatch.setattr(tensor_digest, "CHUNK", 1000)  # the device path in chunks, each a multiple of 127 elements
    assert np.allclose(torch_sketch(values), sketch, rtol=1e-12)
    assert np.allclose(torch_sketch(values.bfloat16()), digest_and_sketch(values.bfloat16())[1], rtol=1e-12)
    wrong = values.clone()
    wrong.view(-1)[-1] *= 1 + 1e-3
    moved = np.abs(digest_and_sketch(wrong)[1] - sketch)
    assert np.count_nonzero(moved) == 1
    column = values.clone()
    column[:, 5] *= 1 + 1e-3
    assert np.count_nonzero(np.abs(digest_and_sketch(column)[1] - sketch)) == SKETCH_BUCKETS
    assert digest_and_sketch(torch.ones(100))[1] is None and digest_and_sketch(torch.arange(5000))[1] is None
