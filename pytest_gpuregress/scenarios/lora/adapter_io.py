"""Rank side: save the adapter as users do (save_pretrained, safetensors; fault points ``gather_for_save`` and
``write_adapter``) and reload it into a fresh base model. The checks' full tensors come from ``full_tensor``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...fault_points import fault_point

ADAPTER_FILE = "adapter_model.safetensors"


def full_tensor(tensor: Any) -> Any:
    """The whole tensor: DTensors (FSDP2 shards) are gathered from every rank, a collective; others as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def to_numpy(tensor: Any) -> np.ndarray:
    """A CPU copy; bf16 goes through fp32 (numpy has no bf16), which is exact."""
    import torch

    value = full_tensor(tensor).detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy().copy()


@fault_point("lora.gather_for_save")
def gather_for_save(model: Any) -> dict[str, Any]:
    """The full state dict, every rank's slice, on rank 0 (empty elsewhere): torch's FSDP2 path. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@fault_point("lora.write_adapter")
def write_adapter(peft_model: Any, state_dict: dict[str, Any], folder: str) -> None:
    """peft's save_pretrained, safetensors only. peft picks the adapter tensors out of ``state_dict``."""
    peft_model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)


def read_saved(folder: str) -> dict[str, np.ndarray]:
    """The saved adapter file as numpy arrays (peft's keys); a missing file is an empty dict."""
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_FILE)
    if not os.path.isfile(path):
        return {}
    return {key: to_numpy(value) for key, value in load_file(path).items()}


def reload(base: Any, folder: str) -> Any:
    """The adapter in ``folder`` on a freshly built base model, as users reload it."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, folder, is_trainable=False)
