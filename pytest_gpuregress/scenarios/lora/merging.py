"""Rank side: merge the adapter into the base weights (peft's merge_and_unload, a fault point) and compare with the
unmerged model."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...fault_points import fault_point
from ...training.projections import is_parameter_wrapper
from . import adapter, adapter_io, bounds, checks


@fault_point("lora.merge_and_unload")
def merge_and_unload(peft_model: Any) -> Any:
    return peft_model.merge_and_unload()


def check_merge(fresh_base: Any, trained: dict[str, np.ndarray], cfg: dict[str, Any], batch: Any,
                compute_dtype: Any) -> tuple[list[checks.Finding], dict[str, float]]:
    """Merged against unmerged on a fresh base model carrying the trained adapter: weights and logits. Returns the
    findings and what was measured (the record keeps it to show the bounds are not vacuous)."""
    import torch

    model = _with_adapter(fresh_base, trained, cfg, batch.device, compute_dtype)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[compute_dtype]
    # W, A and B as the merge sees them: already in the compute dtype. Parameters peft wrapped itself (fused MoE
    # experts: ParamWrapper) merge in a layout of peft's own; the merged logits below judge them.
    every = _lora_layers(model)
    layers = {module: layer for module, layer in every.items() if not is_parameter_wrapper(layer)}
    # GPT-2's Conv1D stores its weight as [in, out] (peft's fan_in_fan_out): the checks read every weight as
    # [out, in], where the merge is W + s * B @ A.
    flipped = {module for module, layer in layers.items() if getattr(layer, "fan_in_fan_out", False)}
    base_weights = {module: _out_in(adapter_io.to_numpy(layer.base_layer.weight), module in flipped)
                    for module, layer in layers.items()}
    factors = {module: (adapter_io.to_numpy(layer.lora_A["default"].weight), adapter_io.to_numpy(layer.lora_B["default"].weight))
               for module, layer in layers.items()}
    with torch.no_grad():
        unmerged = adapter_io.to_numpy(model(input_ids=batch).logits.float())
    merged_model = merge_and_unload(model)
    merged_weights = {name.removesuffix(".weight"): adapter_io.to_numpy(p) for name, p in merged_model.named_parameters()}
    with torch.no_grad():
        merged = adapter_io.to_numpy(merged_model(input_ids=batch).logits.float())

    findings, worst_ratio = _weight_findings(layers, base_weights, factors, merged_weights, flipped, dtype)
    # Every adapter's inner dimension bounds the merged logits, the wrapped parameters' too (their merge rounds alike).
    inner = [base.shape[1] for base in base_weights.values()] + _wrapped_inner(every)
    bound = bounds.logits_bound(float(np.max(np.abs(unmerged))), inner, int(cfg["lora_r"]), dtype)
    findings += _logit_findings(findings, unmerged, merged, bound)
    deviation = float(np.max(np.abs(unmerged.astype(np.float64) - merged)))
    return findings, {"logit_deviation": deviation, "logit_bound": bound, "weight_error_over_bound": worst_ratio}


def _with_adapter(fresh_base: Any, trained: dict[str, np.ndarray], cfg: dict[str, Any], device: Any,
                  compute_dtype: Any) -> Any:
    """A fresh base model carrying the trained adapter, its parameters in the compute dtype."""
    model = adapter.wrap_with_lora(fresh_base, cfg)
    adapter.load_adapter_tensors(model, trained)
    model.to(device)
    for param in model.parameters():  # the compute dtype, as training's mixed-precision policy casts; buffers stay
        param.data = param.data.to(compute_dtype)
    return model


def _wrapped_inner(layers: dict[str, Any]) -> list[int]:
    """The inner dimensions of the parameters peft wrapped itself (fused MoE experts)."""
    return [int(layer.in_features) for layer in layers.values() if is_parameter_wrapper(layer)]


def _weight_findings(layers: dict[str, Any], base_weights: dict[str, np.ndarray],
                     factors: dict[str, tuple[np.ndarray, np.ndarray]], merged_weights: dict[str, np.ndarray],
                     flipped: set[str], dtype: str) -> tuple[list[checks.Finding], float]:
    """Each merged weight against W + s * B @ A within its bound, and the worst error as a fraction of the bound."""
    findings: list[checks.Finding] = []
    worst_ratio = 0.0
    for module, base in base_weights.items():
        lora_a, lora_b = factors[module]
        # The layer's own scaling, as its forward applies it: the merge must agree with the adapter's forward (a
        # peft release that scales by alpha / sqrt(r) changes both, which the float64 oracle names as the library).
        scale = float(layers[module].scaling["default"])
        merged_w = merged_weights.get(module)
        if merged_w is None:
            findings.append(checks.finding("merge", f"merge_and_unload left no weight for {module}"))
            continue
        merged_w = _out_in(merged_w, module in flipped)
        findings += checks.check_merged_weight(module, merged_w, base, lora_a, lora_b, scale, dtype)
        if merged_w.shape == base.shape:
            worst_ratio = max(worst_ratio, bounds.merge_excess(merged_w, base, lora_a, lora_b, scale, dtype).worst_ratio)
    return findings, worst_ratio


def _logit_findings(weight_findings: list[checks.Finding], unmerged: np.ndarray, merged: np.ndarray,
                    bound: float) -> list[checks.Finding]:
    """Merged logits against unmerged within ``bound``; where a merged weight is off by an exact factor, the logits
    that follow it are its consequence and carry its facts."""
    logits = checks.check_logits("merge", "merged (merge_and_unload) against unmerged", unmerged, merged, bound)
    arithmetic = next((f for f in weight_findings if f["facts"].get("factor") is not None), None)
    if arithmetic is not None:
        logits = [{**f, "message": f"{f['message']} (the merged weight above, off by an exact factor, explains it)",
                   "facts": arithmetic["facts"]} for f in logits]
    return logits


def _lora_layers(model: Any) -> dict[str, Any]:
    """Targeted module name (without peft's prefix) -> its LoRA layer."""
    return {name.removeprefix("base_model.model."): module for name, module in model.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")}


def _out_in(weight: Any, flipped: bool) -> Any:
    """``weight`` as [out_features, in_features]; a Conv1D's ([in, out]) transposed."""
    return weight.T if flipped else weight
