"""A library release that computes another function: each mode replaces the library's function where it is defined.

Installed in every launch, the float64 oracle's too: it is code on the machine, not a fault of the stack
(``FaultKind.installed_code``).
  rope_interleaved    Llama ``rotate_half`` pairs neighbouring features (GPT-J) instead of the two halves
  lora_rslora         peft scales an adapter by alpha / sqrt(r) instead of alpha / r
  untied              ``tie_weights`` ties nothing
  numpy_searchsorted  returns the next index for one value in 64: the synthetic tokens change
  accelerate_divisor  ``Accelerator.backward`` also divides the loss by the number of processes
  rmsnorm_no_upcast   ``LlamaRMSNorm`` normalises in the input's dtype, without its float32 upcast
  torch_rand_shift    torch's CPU generator draws one number more before each ``torch.rand``
"""

from __future__ import annotations

import math
from typing import Any

from . import FaultSpec
from .fired import Firing, patch


def _interleaved(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
        def rotate_half(x: Any) -> Any:
            import torch

            firing.fire()
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        return rotate_half

    return wrap


def _rslora(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
        def update_layer(self: Any, adapter_name: str, r: int, lora_alpha: int, *args: Any, **kwargs: Any) -> Any:
            out = original(self, adapter_name, r, lora_alpha, *args, **kwargs)
            if adapter_name in self.scaling:
                self.scaling[adapter_name] = lora_alpha / math.sqrt(r)
                firing.fire()
            return out

        return update_layer

    return wrap


def _not_tying(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
        def tie_weights(self: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
                firing.fire()  # only where the config asks for a tie: elsewhere the release changes nothing
                return None
            return original(self, *args, **kwargs)

        return tie_weights

    return wrap


def _searchsorted_off(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
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

    return wrap


def _divides_by_processes(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
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

    return wrap


def _norm_without_upcast(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
        def forward(self: Any, hidden_states: Any) -> Any:
            import torch

            if hidden_states.dtype in (torch.float32, torch.float64):
                return original(self, hidden_states)
            firing.fire()
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

        return forward

    return wrap


def _rand_shifted(firing: Firing) -> Any:
    def wrap(original: Any) -> Any:
        def rand(*size: Any, **kwargs: Any) -> Any:
            import torch

            generator = kwargs.get("generator")
            device = generator.device if generator is not None else kwargs.get("device") or torch.get_default_device()
            if torch.device(device).type == "cpu":
                original(1, generator=generator)  # one draw more: every later number shifts by one
                firing.fire()
            return original(*size, **kwargs)

        return rand

    return wrap


def install(spec: FaultSpec, ctx: Any) -> Firing:
    firing = Firing(spec.text)
    if spec.get("mode") == "numpy_searchsorted":
        import numpy

        patch(ctx, numpy, "searchsorted", _searchsorted_off(firing))
    elif spec.get("mode") == "rope_interleaved":
        from transformers.models.llama import modeling_llama

        patch(ctx, modeling_llama, "rotate_half", _interleaved(firing))
    elif spec.get("mode") == "accelerate_divisor":
        from accelerate import Accelerator

        patch(ctx, Accelerator, "backward", _divides_by_processes(firing))
    elif spec.get("mode") == "rmsnorm_no_upcast":
        from transformers.models.llama import modeling_llama

        patch(ctx, modeling_llama.LlamaRMSNorm, "forward", _norm_without_upcast(firing))
    elif spec.get("mode") == "torch_rand_shift":
        import torch

        patch(ctx, torch, "rand", _rand_shifted(firing))
    elif spec.get("mode") == "untied":
        from transformers import PreTrainedModel

        patch(ctx, PreTrainedModel, "tie_weights", _not_tying(firing))
    else:
        from peft.tuners.lora.layer import LoraLayer

        patch(ctx, LoraLayer, "update_layer", _rslora(firing))
    return firing
