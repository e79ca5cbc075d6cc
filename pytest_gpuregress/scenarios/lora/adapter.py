"""Rank side: put a peft LoRA adapter on the base model, with platform-independent initial values (``wrap_with_lora``
is a fault point: faults/lora.py leaves a base weight trainable, as a broken peft release would)."""

from __future__ import annotations

import math
from typing import Any

from ...fault_points import fault_point
from ...training.seeding import seeded_normal
from . import checks


def module_targets(model: Any) -> list[str] | None:
    """The ``target_modules`` peft kept for a wrapped ``model`` where it turned others into ``target_parameters``
    (transformers 5's fused MoE experts: ``gate_proj``, ``up_proj``, ``down_proj`` become the experts'
    ``gate_up_proj`` and ``down_proj``); None where it wrapped no parameter."""
    config = model.peft_config["default"]
    if not getattr(config, "target_parameters", None):
        return None
    return sorted(config.target_modules or [])


def targeted_modules(model: Any, targets: list[str]) -> list[str]:
    """The linear layers of a plain (not yet wrapped) model that ``targets`` selects, by their names: Linear and
    GPT-2's Conv1D, matched as peft matches them (a dotted suffix too), so the checks see every adapted module."""
    from ...training.projections import is_projection, matches

    return [name for name, module in model.named_modules()
            if is_projection(module) and any(matches(t, name) for t in targets)]


@fault_point("lora.wrap")
def wrap_with_lora(base: Any, cfg: dict[str, Any]) -> Any:
    """The peft model: base weights frozen, lora_A from the counter-based seed (not torch's RNG), lora_B zero."""
    import torch
    from peft import LoraConfig, get_peft_model

    # No dropout in training: the run must be a pure function of the seed (dropout_check.py checks it instead).
    model = get_peft_model(base, LoraConfig(r=int(cfg["lora_r"]), lora_alpha=int(cfg["lora_alpha"]),
                                            target_modules=list(cfg["target_modules"]),
                                            lora_dropout=float(cfg.get("lora_dropout", 0.0)), bias="none"))
    seed = int(cfg["seed"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            parts = checks.split_adapter_name(name)
            if parts is None:
                continue
            if parts[1] == "lora_A":  # peft's kaiming-uniform(a=sqrt(5)) has std 1/sqrt(3 fan_in); same spread
                std = 1 / math.sqrt(3 * param.shape[1])
                param.copy_(torch.from_numpy(seeded_normal(seed, checks.canonical(name), tuple(param.shape), std)))
            else:
                param.zero_()
    return model


def load_adapter_tensors(model: Any, tensors: dict[str, Any]) -> None:
    """Copy adapter tensors (by parameter name) into a freshly wrapped model."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, values in tensors.items():
            params[name].copy_(torch.as_tensor(values))
