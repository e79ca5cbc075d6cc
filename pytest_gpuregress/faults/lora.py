"""LoRA faults, installed on a rank: the peft/accelerate bugs the lora scenario's checks exist to catch.

Each mode (KINDS["lora"] says what it does) intercepts one ``lora.*`` fault point or patches a library
function, undone through ``ctx.cleanup_hooks``; rank0_slice is accelerate #4206.
"""

from __future__ import annotations

from typing import Any

from ..fault_points import intercept
from . import FaultSpec
from .fired import Firing, patch

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def target_module(spec: FaultSpec) -> str:
    proj = spec.get("proj", "q_proj")
    return f"model.layers.{spec.get('layer', 1)}.{_BLOCK[proj]}.{proj}"


def _sharded_only(firing: Firing) -> Any:
    """Accelerator.get_state_dict, returning each rank's local shard where the model is sharded."""
    def wrap(original: Any) -> Any:
        def get_state_dict(self: Any, model: Any, unwrap: bool = True) -> dict[str, Any]:
            state = model.state_dict()
            if not any(hasattr(value, "to_local") for value in state.values()):
                return original(self, model, unwrap=unwrap)  # whole tensors: nothing to slice
            firing.fire()
            return {name: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu()
                    for name, value in state.items()}
        return get_state_dict
    return wrap


def install(spec: FaultSpec, ctx: Any) -> Firing:
    module = target_module(spec)
    mode = spec.get("mode")
    firing = Firing(spec.text)  # calls of the fault point the bug changed
    if mode == "grad_leak":
        def leak(original: Any) -> Any:
            def wrap_with_lora(base: Any, cfg: dict[str, Any]) -> Any:
                model = original(base, cfg)
                firing.fire()
                model.get_parameter(f"base_model.model.{module}.base_layer.weight").requires_grad_(True)
                return model
            return wrap_with_lora
        ctx.cleanup_hooks.append(intercept("lora.wrap", leak))
    elif mode == "rank0_slice":
        def local_shards(original: Any) -> Any:
            def gather_for_save(model: Any) -> dict[str, Any]:
                # What the buggy save did: each rank's own shard as if it were the whole tensor.
                firing.fire()
                return {name: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu()
                        for name, value in model.state_dict().items()}
            return gather_for_save
        from accelerate import Accelerator

        ctx.cleanup_hooks.append(intercept("lora.gather_for_save", local_shards))
        patch(ctx, Accelerator, "get_state_dict", _sharded_only(firing))
    elif mode == "zero_lora_b":
        def zeroing(original: Any) -> Any:
            def write_adapter(peft_model: Any, state_dict: dict[str, Any], folder: str) -> None:
                key = f"base_model.model.{module}.lora_B.default.weight"
                state_dict = {**state_dict, key: state_dict[key].detach().clone().zero_()}
                firing.fire()
                original(peft_model, state_dict, folder)
            return write_adapter
        ctx.cleanup_hooks.append(intercept("lora.write_adapter", zeroing))
    elif mode == "merge_ulp":
        def off_by_one_ulp(original: Any) -> Any:
            def merge_and_unload(peft_model: Any) -> Any:
                import torch

                merged = original(peft_model)
                weight = merged.get_parameter(f"{module}.weight")
                with torch.no_grad():
                    weight.copy_(torch.nextafter(weight, torch.full_like(weight, float("inf"))))
                firing.fire()
                return merged
            return merge_and_unload
        ctx.cleanup_hooks.append(intercept("lora.merge_and_unload", off_by_one_ulp))
    elif mode == "merge_scaled_twice":
        def scaled_twice(original: Any) -> Any:
            def merge_and_unload(peft_model: Any) -> Any:
                import torch

                layer = peft_model.get_submodule(f"base_model.model.{module}")
                scale = layer.scaling["default"]
                with torch.no_grad():  # what a merge that applies the scaling twice writes: W + s * s * B @ A
                    wrong = layer.base_layer.weight.detach().clone() + scale * scale * (
                        layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
                merged = original(peft_model)
                with torch.no_grad():
                    merged.get_parameter(f"{module}.weight").copy_(wrong)
                firing.fire()
                return merged
            return merge_and_unload
        ctx.cleanup_hooks.append(intercept("lora.merge_and_unload", scaled_twice))
    elif mode == "forward_wrapped":
        ctx.cleanup_hooks.append(intercept("lora.wrap", _autocast_forward(firing)))
    elif mode in ("dropout_in_eval", "dropout_unseeded"):
        import torch

        patch(ctx, torch.nn.Dropout, "forward", _broken_dropout(mode, firing))
    else:  # dropout_shared (the spec parser admits only the modes above)
        from peft.tuners.lora.layer import Linear

        patch(ctx, Linear, "forward", _shared_dropout(firing))
    return firing


def _autocast_forward(firing: Firing) -> Any:
    """lora.wrap whose peft model runs every forward under an autocast to bfloat16, set on the instance as a library
    that prepares a model for mixed precision sets it: the trained model keeps it, a reloaded one has none."""
    def wrap(original: Any) -> Any:
        def wrap_with_lora(base: Any, cfg: dict[str, Any]) -> Any:
            import types

            import torch

            model = original(base, cfg)
            plain = model.forward

            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                firing.fire()
                device = next(self.parameters()).device.type
                with torch.autocast(device_type=device, dtype=torch.bfloat16):
                    return plain(*args, **kwargs)
            model.forward = types.MethodType(forward, model)
            return model
        return wrap_with_lora
    return wrap


def _shared_dropout(firing: Firing) -> Any:
    """peft's LoRA Linear forward with its active adapter's dropout applied to the input first: the base layer then
    reads the dropped input too (in train mode with lora_dropout > 0, where the dropout check runs)."""
    def wrap(original: Any) -> Any:
        def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            active = [a for a in getattr(self, "active_adapters", []) if a in self.lora_dropout]
            dropout = self.lora_dropout[active[0]] if active else None
            if self.training and dropout is not None and getattr(dropout, "p", 0) > 0:
                firing.fire()
                x = dropout(x)
            return original(self, x, *args, **kwargs)
        return forward
    return wrap


def _broken_dropout(mode: str, firing: Firing) -> Any:
    """nn.Dropout (what peft's lora_dropout is when p > 0) applied in eval mode too, or drawing its masks from a
    generator torch's seed does not reach. Training's adapters have no dropout, so only the dropout check meets it."""
    def wrap(original: Any) -> Any:
        def forward(self: Any, x: Any) -> Any:
            import os

            import torch
            import torch.nn.functional as F

            if mode == "dropout_in_eval" and not self.training and self.p > 0:
                firing.fire()
                return F.dropout(x, self.p, True, self.inplace)
            if mode == "dropout_unseeded" and self.training and self.p > 0:
                firing.fire()
                generator = torch.Generator(device=x.device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
                keep = torch.rand(x.shape, generator=generator, device=x.device) >= self.p
                return x * keep / (1 - self.p)
            return original(self, x)
        return forward
    return wrap
