"""The decoder layers of a model: the repeated blocks the training scenarios shard one by one."""

from __future__ import annotations

from typing import Any


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks ``fully_shard`` wraps one by one: the modules transformers never splits across
    devices (``_no_split_modules``: LlamaDecoderLayer, GPT2Block, ...), in model order."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         "the training scenarios shard each decoder layer")
    return layers
