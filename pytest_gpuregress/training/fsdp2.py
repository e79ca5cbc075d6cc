"""FSDP2 in every training scenario: the units ``fully_shard`` wraps, the parameters each carries, the wrapping.

Units are found from the module objects the scenario wraps (each decoder layer, then the root), never from a
name pattern (GPT-2 and GPT-NeoX name their layers otherwise), so the wrapping and the failure report's
account of which reduce-scatter carried a gradient never disagree. Torch is imported inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

ROOT = ""  # the root unit's module path: the model itself
RESULT_KEY = "fsdp_units"  # where a training record keeps its units (RunRecord.results)
REDUCE_BYTES = {"fp32": 4, "bf16": 2}  # per element, by the reduce dtype (reduce_dtype_of)
REDUCE_DTYPE = "reduce_dtype"  # config key: the gradient reduce-scatter's dtype under bf16 ("fp32" when absent)


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks ``fully_shard`` wraps one by one: the modules transformers never splits across
    devices (``_no_split_modules``: LlamaDecoderLayer, GPT2Block, ...), in model order."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         "the training scenarios shard each decoder layer")
    return layers


def shard_units(model: Any) -> list[tuple[str, Any]]:
    """(module path, module) of every ``fully_shard`` unit, in the order the scenario wraps them: each
    decoder layer, then the root. The paths come from the module objects, whatever the model names them."""
    paths = {id(module): path for path, module in model.named_modules()}
    return [(paths[id(layer)], layer) for layer in decoder_layers(model)] + [(ROOT, model)]


def unit_params(model: Any, units: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Unit path -> the names of the parameters it shards: as fully_shard, its module's that no earlier unit took
    (the root keeps what no decoder layer holds). Call it before wrapping: it matches parameter objects."""
    names = {id(param): name for name, param in model.named_parameters()}
    taken: set[int] = set()
    owned: dict[str, list[str]] = {}
    for path, module in units:
        mine = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        owned[path] = [names[id(p)] for p in mine]
    return owned


def reduce_scatter_bytes(names: list[str], shapes: dict[str, tuple[int, ...]], world_size: int,
                         reduce_dtype: str = "fp32") -> int:
    """Bytes of the reduce-scatter carrying ``names``' gradients in ``reduce_dtype``, each parameter padded on
    dim 0 to a multiple of the world size, as FSDP2 shards it."""
    elements = 0
    for name in names:
        shape = shapes.get(name, ())
        if shape:
            elements += -(-shape[0] // world_size) * world_size * math.prod(shape[1:])
    return elements * REDUCE_BYTES[reduce_dtype]


def describe_units(model: Any, units: list[tuple[str, Any]], world_size: int,
                   reduce_dtype: str = "fp32") -> dict[str, dict[str, Any]]:
    """What a record keeps of the units: path -> {"params": names, "bytes": its reduce-scatter at ``world_size``}."""
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    return {path: {"params": names, "bytes": reduce_scatter_bytes(names, shapes, world_size, reduce_dtype)}
            for path, names in unit_params(model, units).items()}


def unit_of(param: str, units: dict[str, dict[str, Any]]) -> str | None:
    """The path of the unit that carries ``param``; None when the record's units do not list it."""
    return next((path for path, unit in units.items() if param in unit.get("params", ())), None)


def group_label(path: str) -> str:
    """How a report names a unit: "the root group" or "group transformer.h.1"."""
    return "the root group" if path == ROOT else f"group {path}"


def reduce_dtype_of(config: dict[str, Any]) -> str:
    """The dtype a run's gradients are reduce-scattered in: bf16 only where a bf16 run's config says so."""
    return str(config.get(REDUCE_DTYPE, "fp32")) if config.get("dtype") == "bf16" else "fp32"


def mixed_precision(config: dict[str, Any]) -> Any:
    """For "bf16": bf16 parameters, gradients reduced in fp32 (torchtitan's default) or in bf16 where
    ``reduce_dtype`` says so (the CPU bf16 lane: FSDP2's default with only ``param_dtype`` set). Else None."""
    if config.get("dtype") != "bf16":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if reduce_dtype_of(config) == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def shard(units: Sequence[tuple[str, Any]], *, mp_policy: Any = None) -> None:
    """``fully_shard`` every (path, module) of ``units``, in order (the root last), under ``mp_policy`` (a
    MixedPrecisionPolicy from ``mixed_precision``; None: fp32 throughout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for _path, module in units:
        fully_shard(module, mp_policy=policy, reshard_after_forward=None)
