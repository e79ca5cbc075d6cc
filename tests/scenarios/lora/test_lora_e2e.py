"""The lora scenario end to end through pytester: real gloo ranks, peft, FSDP2 and accelerate, injected faults.

One short reference (8 steps, no noise replicas) is recorded once for both wrappers; every test
compares against a copy. Each fault is caught with its check's name, tensor and module in the message.
The resume cases are tests/scenarios/lora/test_lora_resume_e2e.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ...conftest import kept_run_passes, record_references, reproduced

pytestmark = pytest.mark.slow

STEPS = "8"
LORA = "lora and not resume"
FSDP2 = "lora and fully_shard and not resume"
ACCELERATE = "lora and accelerate and not resume"
MODULE = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    refs = record_references(tmp_path_factory.mktemp("lora"), f"--gpuregress-steps={STEPS}", "--gpuregress-replicas=0",
                             "-k", LORA)
    for wrapper in ("fsdp2", "accelerate"):
        assert (refs / "lora" / f"cpu-gloo-w2-fp32-{wrapper}" / "manifest.json").is_file()
    return refs


def run(pytester: pytest.Pytester, refs: Path, selection: str, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={STEPS}",
                              f"--gpuregress-reference-dir={refs}", "-k", selection, *extra)


def test_clean_runs_pass_in_the_exact_and_the_tolerant_lane(pytester: pytest.Pytester, refs: Path) -> None:
    artifacts = pytester.path / "artifacts"
    exact = run(pytester, refs, LORA, "--gpuregress-keep-runs", f"--gpuregress-artifacts={artifacts}")
    exact.assert_outcomes(passed=2)
    platform = "cpu-gloo-w2-fp32-fsdp2"  # the kept run passes again, its LoRA checks included
    assert kept_run_passes(artifacts, "lora-fully_shard", platform, refs / "lora" / platform) == 0
    exact.stdout.fnmatch_lines(["*lora cpu-gloo-w2-fp32-fsdp2: PASSED [[]exact lane[]] 8 steps*",
                                "*lora cpu-gloo-w2-fp32-accelerate: PASSED [[]exact lane[]] 8 steps*"])
    tolerant = run(pytester, refs, LORA, "--gpuregress-lane=tolerant")
    tolerant.assert_outcomes(passed=2)
    # No check's finding ("lora check 'name': ..."); the progress line "gpuregress lora: lora checks" may show.
    assert "lora check '" not in exact.stdout.str() + tolerant.stdout.str()


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_reduce_scatter_corrupted_for_small_messages_only_is_caught(pytester: pytest.Pytester, refs: Path) -> None:
    # Only adapter gradients are reduce-scattered: 33 KiB per decoder layer. The band stops far below
    # the full model's (128-181 KiB in fsdp), so only a small-message bug can reach it.
    fault = "collective:op=reduce_scatter,max_bytes=40000,mode=nudge,rel=1e-3"
    result = run(pytester, refs, FSDP2, f"--gpuregress-inject={fault}")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "lane: exact" in out
    corrupted = [line for line in out.splitlines() if "] step0_grad " in line]
    assert corrupted and all("lora_" in line for line in corrupted), corrupted
    # The step-0 op trace names the collective, in the backward of the layer whose adapter message it carried.
    result.stdout.fnmatch_lines(["first difference: c10d::_reduce_scatter_base_ in base_model.model.model.layers.* "
                                 "(backward; FSDP::post_backward_reduce *), f32[[]*[]] * relative; the * ops before it "
                                 "are bitwise equal (on ranks 0, 1 of 2, step-0 op trace)"])


def test_a_bug_in_foreach_adamw_fails_only_the_case_that_runs_it_and_names_the_implementation(
        pytester: pytest.Pytester, refs: Path) -> None:
    # fully_shard steps AdamW's foreach path, accelerate its fused kernel (ADAMW_OF_WRAPPER): the fault reaches one.
    result = run(pytester, refs, LORA, "--gpuregress-inject=adamw:mode=foreach,factor=1.001",
                 "--gpuregress-lane=tolerant", "-rs")
    result.assert_outcomes(failed=1, skipped=1)
    # The foreach op it moved (tolerant lane) is an optimizer op: that decides, so the findings say [optimizer].
    result.stdout.fnmatch_lines(["*[[]optimizer[]] loss: first differing step * of 8*AdamW implementation: foreach*",
                                 "introduced at: aten::_foreach_* (optimizer)*",
                                 "triage verdict: optimizer. Evidence: *first moved op differs: aten::_foreach_*"])
    result.stdout.fnmatch_lines(["*no injected fault acts in lora-accelerate*"])


def test_each_lanes_reference_keeps_an_op_trace_and_its_distance_from_float64(recorded: Path) -> None:
    import json

    for wrapper in ("fsdp2", "accelerate"):
        results = json.loads((recorded / "lora" / f"cpu-gloo-w2-fp32-{wrapper}" / "record.json").read_text())["results"]
        assert sorted(results["op_trace"]["ranks"]) == ["0", "1"]
        distances = results["oracle_distance"]["per_tensor"]  # the adapter's step-0 gradients against float64
        assert distances and all(".lora_" in name for name in distances), sorted(distances)[:3]
        # lora_B starts at zero: lora_A's step-0 gradient is exactly zero in both; lora_B's is close to float64.
        assert all(d == 0.0 for n, d in distances.items() if ".lora_A." in n)
        lora_b = [d for n, d in distances.items() if ".lora_B." in n]
        assert lora_b and all(d < 1e-4 for d in lora_b) and any(d > 0 for d in lora_b), distances


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_gradient_leaking_into_a_frozen_base_weight_is_caught(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, FSDP2, "--gpuregress-inject=lora:mode=grad_leak")
    result.assert_outcomes(failed=1)
    assert reproduced(result.stdout.str()) == [1]  # the lora checks fail again on the kept run
    result.stdout.fnmatch_lines([
        f"*[[]library: peft[]] lora check 'frozen-base': frozen base weight {MODULE}.base_layer.weight received a gradient "
        "at step 0*the library left it trainable*",
        f"*[[]library: peft[]] lora check 'frozen-base': base weight {MODULE}.base_layer.weight changed during training*"
        "stepped with the gradient it received from step 0*"])
    # the reload onto a fresh base cannot give the trained logits back: not judged, and no wrapper blamed for it
    assert "'adapter-roundtrip'" not in result.stdout.str()


def test_adapter_saved_from_rank_0s_slice_only_is_caught(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, FSDP2, "--gpuregress-inject=lora:mode=rank0_slice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*[[]checkpoint[]] lora check 'sharded-save': lora_A of model.layers.0.self_attn.q_proj saved with shape "
        "[[]4, 64[]], the full tensor is [[]8, 64[]]: the save holds one rank's slice, not every rank's*",
        "*lora check 'adapter-roundtrip': PeftModel.from_pretrained failed on the saved adapter*"])
    assert "not recording" not in result.stdout.str()


def test_the_rank0_slice_fault_is_refused_in_the_cpu_accelerate_lane_with_the_reason(
        pytester: pytest.Pytester, refs: Path) -> None:
    """On a CPU accelerate runs DDP: its get_state_dict holds whole tensors, so the bug has no slice to lose. The
    case is skipped saying so (faults/reach.py), never passed; on GPUs the fault sits in Accelerator.get_state_dict."""
    result = run(pytester, refs, ACCELERATE, "--gpuregress-inject=lora:mode=rank0_slice", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not applicable: --gpuregress-inject lora:mode=rank0_slice: no injected fault acts in "
                                 "lora-accelerate (on a CPU accelerate runs DDP, whose state dict holds whole tensors: "
                                 "no slice to lose (FSDP2 on GPUs)); it acts in lora-fully_shard*"])


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_lora_b_zeroed_on_save_is_caught_in_the_accelerate_lane(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, ACCELERATE, "--gpuregress-inject=lora:mode=zero_lora_b")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"*[[]checkpoint[]] lora check 'adapter-roundtrip': lora_B of {MODULE} is all zeros in the saved file*",
        f"*[[]checkpoint[]] lora check 'adapter-roundtrip': lora_B of {MODULE} is all zeros after reload*",
        "*(the comparison with the reference * passed)*"])


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_merged_weight_one_ulp_off_in_one_layer_is_caught(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, FSDP2, "--gpuregress-inject=lora:mode=merge_ulp,layer=0,proj=down_proj")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*[[]kernel[]] lora check 'merge': merged weight of model.layers.0.mlp.down_proj is off "
        "W + scale*lora_B@lora_A in * elements, up to * ulps*"])
    assert "logits on the fixed batch" not in result.stdout.str()  # one ulp is far below any sound logit bound


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_a_merge_that_applies_the_scaling_twice_is_peft_not_a_kernel(pytester: pytest.Pytester, refs: Path) -> None:
    """Millions of rounding bounds off, but exactly one more factor of the adapter's scaling: arithmetic, not rounding."""
    result = run(pytester, refs, FSDP2, "--gpuregress-inject=lora:mode=merge_scaled_twice,layer=0,proj=down_proj")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*[[]library: peft[]] lora check 'merge': merged weight of model.layers.0.mlp.down_proj is off W + "
        "scale*lora_B@lora_A in *; it is W + 2 x scale*lora_B@lora_A within rounding (the adapter's scaling 2 applied "
        "twice) (rule lora-merge-arithmetic)"])
    assert "[kernel] lora check 'merge'" not in result.stdout.str()


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_a_wrapper_the_reload_does_not_keep_is_the_library_not_the_checkpoint(pytester: pytest.Pytester, refs: Path) -> None:
    """#53: the trained model runs under an autocast a library set on it; the reloaded one does not. Every adapter
    tensor comes back bit for bit, so the round trip clears the checkpoint and names the code, with the wrapper."""
    result = run(pytester, refs, FSDP2, "--gpuregress-inject=lora:mode=forward_wrapped")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*[[]library[]] lora check 'adapter-roundtrip': reloaded against trained (every adapter tensor came back bit "
        "for bit; the trained model's forward is *_autocast_forward.<locals>.*forward, the reloaded model's its "
        "class's): logits on the fixed batch differ by up to * (rule lora-roundtrip-same-tensors)"])
    assert "[checkpoint] lora check 'adapter-roundtrip'" not in result.stdout.str()
    assert "triage verdict: data" not in result.stdout.str()


def test_a_run_that_fails_its_lora_checks_is_never_recorded(pytester: pytest.Pytester, tmp_path: Path) -> None:
    target = tmp_path / "new-refs"
    result = run(pytester, target, FSDP2, "--gpuregress-record", "--gpuregress-replicas=0",
                 "--gpuregress-inject=lora:mode=zero_lora_b")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*not recording 'lora': the run fails its own checks*"])
    assert not (target / "lora").exists()
