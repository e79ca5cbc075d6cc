"""Rank side: the two ways the peft model is distributed, behind one small interface: ``fsdp2``, ``fully_shard``
directly; ``accelerate``, ``Accelerator.prepare`` as the HF Trainer and TRL do (FSDP2 on GPUs, DDP on the CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...training.fsdp2 import mixed_precision
from ...training.loop import clip_gradients
from ...training.optimizer import AdamWSettings, adamw
from ..shared.trainer import fully_sharded
from . import adapter_io


@dataclass
class Wrapped:
    """The peft model under one distribution wrapper (fully_shard, or accelerate): what training calls and steps."""

    model: Any  # what training calls: the sharded peft model, or accelerate's wrapper
    peft_model: Any  # the PeftModel itself (for save_pretrained and per-parameter access)
    optimizer: Any  # what training steps: accelerate's AcceleratedOptimizer under accelerate
    accelerator: Any = None

    @property
    def torch_optimizer(self) -> Any:
        """The torch optimizer itself (under accelerate's wrapper): what DCP's state dicts and digests read."""
        return self.optimizer.optimizer if self.accelerator is not None else self.optimizer

    def backward(self, loss: Any) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def clip(self, max_norm: float) -> float:
        params = _trainable(self.peft_model)
        if self.accelerator is None:
            return clip_gradients(params, max_norm)
        return float(adapter_io.full_tensor(self.accelerator.clip_grad_norm_(params, max_norm)).double())

    def state_dict_for_save(self) -> dict[str, Any]:
        """The full state dict the way this wrapper's users get it (collective; may be empty off rank 0)."""
        if self.accelerator is not None:
            return self.accelerator.get_state_dict(self.model)
        return adapter_io.gather_for_save(self.peft_model)


def _trainable(model: Any) -> list[Any]:
    # What the HF Trainer hands the optimizer: whatever requires grad (so a leaked base weight is trained too).
    return [p for p in model.parameters() if p.requires_grad]


def fsdp2(peft_model: Any, cfg: dict[str, Any], device: Any, world_size: int) -> Wrapped:
    # Each decoder layer of the wrapped model, then the peft model as the root.
    peft_model, _ = fully_sharded(peft_model, device, mixed_precision(cfg), world_size)
    return Wrapped(peft_model, peft_model, adamw(_trainable(peft_model), AdamWSettings.from_config(cfg)))


def accelerate(peft_model: Any, cfg: dict[str, Any], device_kind: str, world_size: int) -> Wrapped:
    from accelerate import Accelerator

    # Our launcher made the process group already; accelerate reads the topology from the environment
    # and refuses a "multi-node" CPU run unless it knows all ranks are local.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    if device_kind == "cuda":
        from accelerate.utils import FullyShardedDataParallelPlugin

        from ...training.models import decoder_layers

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            # the classes transformers never splits: the decoder layers of whatever model this is
            transformer_cls_names_to_wrap=sorted({type(m).__name__ for m in decoder_layers(peft_model.base_model.model)}),
            reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT",
            mixed_precision_policy=mixed_precision(cfg),  # None: accelerate's default, fp32
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True)  # DDP over gloo: all accelerate offers on the CPU
    optimizer = adamw(_trainable(peft_model), AdamWSettings.from_config(cfg))
    # The scheduler stays ours: accelerate's wrapper would step it once per process per optimizer step.
    model, optimizer = accelerator.prepare(peft_model, optimizer)
    return Wrapped(model, accelerator.unwrap_model(model), optimizer, accelerator=accelerator)


def build(peft_model: Any, cfg: dict[str, Any], device_kind: str, world_size: int) -> Wrapped:
    import torch

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu")
    if cfg["wrapper"] == "fsdp2":
        return fsdp2(peft_model, cfg, device, world_size)
    if cfg["wrapper"] == "accelerate":
        return accelerate(peft_model, cfg, device_kind, world_size)
    raise ValueError(f"unknown lora wrapper {cfg['wrapper']!r}; known: fsdp2, accelerate")
