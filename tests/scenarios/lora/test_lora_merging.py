"""The LoRA merge check (scenarios/lora/merging.py) on the tiny Llama in process: peft's merge_and_unload passes
within its rounding bound, and a merge that scales the adapter's product wrongly, or rounds one weight off, is
caught, its factor measured and its component named."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuregress.findings import CheckFinding
from pytest_gpuregress.scenarios.lora import checks
from pytest_gpuregress.scenarios.lora.merging import check_merge, merge_and_unload
from pytest_gpuregress.triage.naming import rule_for

from ..conftest import FAULTED_MODULE, injected, intercepting

SCALE = 16 / 8  # lora_alpha / lora_r of the tiny config
MODULES = 2 * 7  # the tiny Llama's two decoder layers, seven projections each


def merged(tiny: dict[str, Any], lora_b_scale: float = 1.0) -> tuple[list[checks.Finding], dict[str, float]]:
    """The merge check on a fresh tiny Llama carrying the fixture's adapter (its lora_B times ``lora_b_scale``), in
    fp32."""
    import torch

    trained = {name: values * (lora_b_scale if "lora_B" in name else 1.0) for name, values in tiny["trained"].items()}
    return check_merge(tiny["base"](), trained, tiny["cfg"], tiny["batch"], torch.float32)


def named(findings: list[checks.Finding]) -> set[tuple[str, str]]:
    """(component, rule id) that triage names each finding by."""
    return {(rule.component, rule.id) for rule in (rule_for(CheckFinding.of(f)) for f in findings)}


def weight_findings(findings: list[checks.Finding]) -> list[checks.Finding]:
    return [f for f in findings if f["message"].startswith("merged weight of ")]


def test_peft_merge_on_this_stack_passes_within_a_bound_that_is_not_vacuous(tiny: dict[str, Any]) -> None:
    """The real merge passes, and its measured errors lie inside bounds they come near: the bounds are tight."""
    findings, measured = merged(tiny)
    assert findings == []
    assert 0 < measured["logit_deviation"] <= measured["logit_bound"] < 1e-3
    assert 0 < measured["weight_error_over_bound"] <= 1


def test_the_merge_fault_point_is_peft_merge_and_unload(tiny: dict[str, Any]) -> None:
    """merge_and_unload gives back the plain base model, its targeted weights W + scale * B @ A."""
    import torch

    from pytest_gpuregress.scenarios.lora import adapter

    peft_model = adapter.wrap_with_lora(tiny["base"](), tiny["cfg"])
    adapter.load_adapter_tensors(peft_model, tiny["trained"])
    layer = peft_model.get_submodule(f"base_model.model.{FAULTED_MODULE}")
    expected = layer.base_layer.weight.detach() + SCALE * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    plain = merge_and_unload(peft_model)
    assert not any(checks.is_adapter(name) for name, _ in plain.named_parameters())
    assert torch.allclose(plain.get_parameter(f"{FAULTED_MODULE}.weight"), expected, rtol=0, atol=1e-6)


def test_a_merge_that_applies_the_scaling_twice_is_caught_as_peft_arithmetic(tiny: dict[str, Any]) -> None:
    """The injected merge_scaled_twice fault: one layer merged as W + s*s*B@A, the factor s measured, peft named."""
    with injected("lora:mode=merge_scaled_twice") as fault:
        findings, _ = merged(tiny)
    assert fault.count == 1
    (weight,) = weight_findings(findings)
    assert weight["message"].startswith(f"merged weight of {FAULTED_MODULE} ")
    assert weight["facts"]["factor"] == pytest.approx(SCALE, rel=1e-3) and weight["facts"]["scale"] == SCALE
    assert "scaling 2 applied twice" in weight["message"]
    assert len(findings) == 2  # the merged logits move too, and carry the weight's facts
    assert all(f["facts"] == weight["facts"] for f in findings)
    assert named(findings) == {("library: peft", "lora-merge-arithmetic")}


def test_a_merge_that_drops_the_scaling_is_caught_in_every_layer(tiny: dict[str, Any]) -> None:
    """A merge that adds B @ A unscaled (each layer's scaling read as 1 while merging) is W + (1/s) x s*B@A in
    every targeted module: caught, its factor 1/s, peft's arithmetic."""

    def unscaled(original: Any) -> Any:
        def merge(peft_model: Any) -> Any:
            layers = [m for m in peft_model.modules() if hasattr(m, "lora_A")]
            kept = [layer.scaling["default"] for layer in layers]
            for layer in layers:
                layer.scaling["default"] = 1.0
            try:
                return original(peft_model)
            finally:  # the layers' forward keeps its scaling: only the merge dropped it
                for layer, scale in zip(layers, kept):
                    layer.scaling["default"] = scale
        return merge

    with intercepting("lora.merge_and_unload", unscaled):
        findings, measured = merged(tiny)
    weights = weight_findings(findings)
    assert len(weights) == MODULES
    assert [f["facts"]["factor"] for f in weights] == pytest.approx([1 / SCALE] * MODULES, rel=1e-3)
    assert all("scaling 2 left out" in f["message"] for f in weights)
    assert measured["logit_deviation"] > measured["logit_bound"]
    assert named(findings) == {("library: peft", "lora-merge-arithmetic")}


def test_a_merged_weight_one_ulp_off_is_caught_as_rounding_beyond_the_bound(tiny: dict[str, Any]) -> None:
    """The injected merge_ulp fault: one layer's merged weight one ulp up; no factor explains it, so it is the
    kernels' rounding, beyond the bound; the logits, a billionth apart, stay within theirs. (An adapter as small as
    a short training leaves it, lora_B near 1e-5: the rounding of s*B@A then is far below an ulp of W, and the
    bound half an ulp. The fixture's larger adapter may round by more than one ulp: there the bound allows it.)"""
    with injected("lora:mode=merge_ulp,layer=0,proj=down_proj") as fault:
        findings, measured = merged(tiny, lora_b_scale=1e-3)
    assert fault.count == 1
    (weight,) = findings
    assert weight["message"].startswith("merged weight of model.layers.0.mlp.down_proj ")
    assert weight["facts"] == {}
    assert measured["weight_error_over_bound"] > 1 and measured["logit_deviation"] <= measured["logit_bound"]
    assert named(findings) == {("kernel", "lora-merge-rounding")}
