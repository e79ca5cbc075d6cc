"""Rank side: the two ways the peft model is distributed, behind one small interface.

fsdp2       ``fully_shard`` on every decoder layer and the root, directly (torch's FSDP2).
accelerate  ``Accelerator.prepare``, as the HF Trainer and TRL do: on GPUs with accelerate's FSDP2
            plugin; on the CPU accelerate offers DDP only, so that is what this lane runs there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import adapter_io


@dataclass
class Lane:
    model: Any  # what training calls: the sharded peft model, or accelerate's wrapper
    peft_model: Any  # the PeftModel itself (for save_pretrained and per-parameter access)
    optimizer: Any
    sharded: bool  # gradients are DTensor shards (sum over ranks) rather than replicas (identical on every rank)
    accelerator: Any = None

    def backward(self, loss: Any) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def clip(self, max_norm: float) -> float:
        params = [p for p in self.peft_model.parameters() if p.requires_grad]
        if self.accelerator is not None:
            total = self.accelerator.clip_grad_norm_(params, max_norm)
        else:
            import torch

            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(adapter_io.full_tensor(total).double())

    def state_dict_for_save(self) -> dict[str, Any]:
        """The full state dict the way this lane's users get it (collective; may be empty off rank 0)."""
        if self.accelerator is not None:
            return self.accelerator.get_state_dict(self.model)
        return adapter_io.gather_for_save(self.peft_model)


def _optimizer(params: list[Any], cfg: dict[str, Any]) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=float(cfg["lr"]), betas=tuple(cfg["betas"]), eps=float(cfg["eps"]),
                             weight_decay=float(cfg["weight_decay"]), foreach=False)


def _trainable(model: Any) -> list[Any]:
    # What the HF Trainer hands the optimizer: whatever requires grad (so a leaked base weight is trained too).
    return [p for p in model.parameters() if p.requires_grad]


def fsdp2(peft_model: Any, cfg: dict[str, Any], device: Any) -> Lane:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ...training.models import decoder_layers

    peft_model = peft_model.to(device)
    policy = MixedPrecisionPolicy()
    if cfg["dtype"] == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(peft_model.base_model.model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(peft_model, mp_policy=policy)
    return Lane(peft_model, peft_model, _optimizer(_trainable(peft_model), cfg), sharded=True)


def accelerate(peft_model: Any, cfg: dict[str, Any], device_kind: str, world_size: int) -> Lane:
    from accelerate import Accelerator

    # Our launcher made the process group already; accelerate reads the topology from the environment
    # and refuses a "multi-node" CPU run unless it knows all ranks are local.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    if device_kind == "cuda":
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from ...training.models import decoder_layers

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            # the classes transformers never splits: the decoder layers of whatever model this is
            transformer_cls_names_to_wrap=sorted({type(m).__name__ for m in decoder_layers(peft_model.base_model.model)}),
            reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT",
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if cfg["dtype"] == "bf16" else None,
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True)  # DDP over gloo: all accelerate offers on the CPU
    optimizer = _optimizer(_trainable(peft_model), cfg)
    # The scheduler stays ours: accelerate's wrapper would step it once per process per optimizer step.
    model, optimizer = accelerator.prepare(peft_model, optimizer)
    return Lane(model, accelerator.unwrap_model(model), optimizer, sharded=device_kind == "cuda", accelerator=accelerator)


def build(peft_model: Any, cfg: dict[str, Any], device_kind: str, world_size: int) -> Lane:
    import torch

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu")
    if cfg["wrapper"] == "fsdp2":
        return fsdp2(peft_model, cfg, device)
    if cfg["wrapper"] == "accelerate":
        return accelerate(peft_model, cfg, device_kind, world_size)
    raise ValueError(f"unknown lora wrapper {cfg['wrapper']!r}; known: fsdp2, accelerate")
