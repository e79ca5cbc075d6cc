"""A library release that computes another function: each mode replaces the library's function where it is defined.

Installed in every launch, the float64 oracle's too: it is code on the machine, not a fault of the stack
(``FaultKind.installed_code``). KINDS["library"] says what each mode does.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

from . import FaultSpec
from .fired import Firing, patch


def _interleaved(firing: Firing, original: Any) -> Any:
    def rotate_half(x: Any) -> Any:
        import torch

        firing.fire()
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return rotate_half


def _rslora(firing: Firing, original: Any) -> Any:
    def update_layer(self: Any, adapter_name: str, r: int, lora_alpha: int, *args: Any, **kwargs: Any) -> Any:
        out = original(self, adapter_name, r, lora_alpha, *args, **kwargs)
        if adapter_name in self.scaling:
            self.scaling[adapter_name] = lora_alpha / math.sqrt(r)
            firing.fire()
        return out

    return update_layer


def _not_tying(firing: Firing, original: Any) -> Any:
    def tie_weights(self: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            firing.fire()  # only where the config asks for a tie: elsewhere the release changes nothing
            return None
        return original(self, *args, **kwargs)

    return tie_weights


def _searchsorted_off(firing: Firing, original: Any) -> Any:
    def searchsorted(a: Any, v: Any, side: str = "left", sorter: Any = None) -> Any:
        import numpy as np

        found = original(a, v, side=side, sorter=sorter)
        if np.ndim(found) == 0:
            return found
        found = np.array(found, copy=True)
        found.reshape(-1)[::64] += 1  # through memory: one index in 64 is the next one
        firing.fire()
        return found

    return searchsorted


def _divides_by_processes(firing: Firing, original: Any) -> Any:
    def backward(self: Any, loss: Any, **kwargs: Any) -> Any:
        steps = self.gradient_accumulation_steps
        if self.num_processes > 1:
            self.gradient_accumulation_steps = steps * self.num_processes
            firing.fire()
        try:
            return original(self, loss, **kwargs)
        finally:
            self.gradient_accumulation_steps = steps

    return backward


def _norm_without_upcast(firing: Firing, original: Any) -> Any:
    def forward(self: Any, hidden_states: Any) -> Any:
        import torch

        if hidden_states.dtype in (torch.float32, torch.float64):
            return original(self, hidden_states)
        firing.fire()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    return forward


DEFAULT_EPS = 1e-6  # LlamaRMSNorm's own default, which the tiny models' config (1e-5) replaces


def _norm_default_eps(firing: Firing, original: Any) -> Any:
    def forward(self: Any, hidden_states: Any) -> Any:
        configured = self.variance_epsilon
        if configured == DEFAULT_EPS:  # a model configured with the default: the fault changes nothing there
            return original(self, hidden_states)
        firing.fire()
        self.variance_epsilon = DEFAULT_EPS
        try:
            return original(self, hidden_states)
        finally:
            self.variance_epsilon = configured

    return forward


def _rand_shifted(firing: Firing, original: Any) -> Any:
    def rand(*size: Any, **kwargs: Any) -> Any:
        import torch

        generator = kwargs.get("generator")
        device = generator.device if generator is not None else kwargs.get("device") or torch.get_default_device()
        if torch.device(device).type == "cpu":
            original(1, generator=generator)  # one draw more: every later number shifts by one
            firing.fire()
        return original(*size, **kwargs)

    return rand


# mode -> (module, class or "" for the module itself, the attribute replaced, its replacement)
PATCHES: dict[str, tuple[str, str, str, Callable[[Firing, Any], Any]]] = {
    "rope_interleaved": ("transformers.models.llama.modeling_llama", "", "rotate_half", _interleaved),
    "lora_rslora": ("peft.tuners.lora.layer", "LoraLayer", "update_layer", _rslora),
    "untied": ("transformers", "PreTrainedModel", "tie_weights", _not_tying),
    "numpy_searchsorted": ("numpy", "", "searchsorted", _searchsorted_off),
    "accelerate_divisor": ("accelerate", "Accelerator", "backward", _divides_by_processes),
    "rmsnorm_no_upcast": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "forward", _norm_without_upcast),
    "rmsnorm_default_eps": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "forward", _norm_default_eps),
    "torch_rand_shift": ("torch", "", "rand", _rand_shifted),
}


def install(spec: FaultSpec, ctx: Any) -> Firing:
    firing = Firing(spec.text)
    module_name, owner, attribute, replacement = PATCHES[spec.get("mode")]
    module = importlib.import_module(module_name)
    patch(ctx, getattr(module, owner) if owner else module, attribute, functools.partial(replacement, firing))
    return firing
