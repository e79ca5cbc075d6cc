"""Stochastic layers are switched off for training, and recorded: dropout masks cannot be compared across stacks.

Masks differ between one rank and two and with the library's init order, so dropout would fail triage's
equivalence and every transformers upgrade. Dropout probabilities and MoE router jitter are set to zero
(config fields, then any ``nn.Dropout`` left with p > 0); the config's ``dropout_off`` says what was.
"""

from __future__ import annotations

import functools
import re
from typing import Any

# Config fields whose positive value makes training draw random numbers: dropout of every kind, GPT-2's
# *_pdrop, layer drop, MoE router jitter.
STOCHASTIC_FIELD = re.compile(r"(dropout|pdrop|layerdrop|jitter)", re.IGNORECASE)


def stochastic_fields(config: Any) -> dict[str, float]:
    """The config's stochastic fields with a positive value, by name (a nested text_config's as text_config.x)."""
    found: dict[str, float] = {}
    for name, value in sorted(vars(config).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and STOCHASTIC_FIELD.search(name):
            found[name] = float(value)
        elif name == "text_config" and hasattr(value, "__dict__"):  # None has no __dict__
            found.update({f"{name}.{k}": v for k, v in stochastic_fields(value).items()})
    return found


def switch_off(config: Any) -> dict[str, float]:
    """Set every stochastic field of ``config`` to 0 (in place); return what was on."""
    found = stochastic_fields(config)
    for dotted in found:
        owner, _, field = dotted.rpartition(".")
        target = getattr(config, owner) if owner else config
        setattr(target, field, 0.0 if isinstance(getattr(target, field), float) else 0)
    return found


def silence_modules(model: Any) -> dict[str, float]:
    """Set p = 0 on every dropout module still on (one a config field did not reach); return their old p."""
    import torch

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found[name] = float(module.p)
            module.p = 0.0
    return found


@functools.lru_cache(maxsize=16)
def config_file_dropout(path: str) -> tuple[tuple[str, float], ...]:
    """The stochastic fields the config file itself sets (session side). Not through transformers: a new positive
    default must not change the stored config (a foreign reference); training switches it off all the same."""
    import json
    from types import SimpleNamespace

    def namespace(values: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(**{k: namespace(v) if isinstance(v, dict) else v for k, v in values.items()})

    with open(path) as fh:
        return tuple(stochastic_fields(namespace(json.load(fh))).items())


def describe(switched: dict[str, float] | tuple[tuple[str, float], ...]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in dict(switched).items())
