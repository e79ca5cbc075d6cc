"""The FSDP2 units of a training model: which modules ``fully_shard`` wraps, and which parameters each carries.

Found from the module objects the scenario wraps, never from a name pattern (GPT-2 and GPT-NeoX name their
layers otherwise), so a failure report names the reduce-scatter that carried a gradient. Torch-free.
"""

from __future__ import annotations

from typing import Any

ROOT = ""  # the root unit's module path: the model itself
RESULT_KEY = "fsdp_units"  # where a training record keeps its units (RunRecord.results)
REDUCE_BYTES = {"fp32": 4, "bf16": 2}  # per element, by the reduce dtype (fsdp2.py: reduce_dtype_of)


def shard_units(model: Any) -> list[tuple[str, Any]]:
    """(module path, module) of every ``fully_shard`` unit, in the order the scenario wraps them: each
    decoder layer, then the root. The paths come from the module objects, whatever the model names them."""
    from .layers import decoder_layers

    paths = {id(module): path for path, module in model.named_modules()}
    return [(paths[id(layer)], layer) for layer in decoder_layers(model)] + [(ROOT, model)]


def unit_params(model: Any, units: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Unit path -> the names (as ``model.named_parameters`` gives them) of the parameters it shards.

    As fully_shard does: a unit takes its module's parameters that no unit wrapped before it, so the
    root keeps only what no decoder layer holds. Call it before wrapping: fully_shard replaces the
    parameter objects this matches by identity."""
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
        if not shape:
            continue
        rest = 1
        for d in shape[1:]:
            rest *= d
        elements += -(-shape[0] // world_size) * world_size * rest
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
