"""Build a model without running its own weight initialisation: its parameters are made on the meta device.

seeding.py overwrites every initial value, so the library's init (5 s at GPU size) would be wasted. Buffers
are still computed on the real device by the module's own code. A module whose construction reads a
parameter falls back to the plain build (``without_init``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

M = TypeVar("M")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, each parameter registered with a module is moved to the meta device (buffers are not)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            # As accelerate's init_empty_weights: the same Parameter class, its flag and attributes kept.
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def on_meta(model: Any) -> list[str]:
    """``model``'s buffers and plain tensor attributes (a mask made from a weight) left on meta: values only the
    plain build computes."""
    import torch

    left = [name for name, buffer in model.named_buffers() if buffer.device.type == "meta"]
    for path, module in model.named_modules():
        left += [f"{path}.{name}" if path else name for name, value in vars(module).items()
                 if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                 and value.device.type == "meta"]
    return left


def materialise(model: Any, device: str = "cpu") -> None:
    """Give every meta parameter uninitialised memory on ``device``; a parameter shared by two modules (tied
    embeddings) stays one parameter."""
    import torch

    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                real = type(param)(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                made[id(param)] = real
            module._parameters[name] = made[id(param)]


def without_init(make: Callable[[], M], device: str = "cpu") -> tuple[M, bool]:
    """(``make()``'s model with uninitialised parameters on ``device``, True); or, where it cannot be built on
    meta parameters, (the plain build, False). Overwrite every parameter afterwards (seeding.seed_parameters)."""
    try:
        with parameters_on_meta():
            model = make()
        if on_meta(model):  # a buffer derived from a parameter has no value: only the plain build computes it
            return make(), False
        materialise(model, device)
    except Exception:  # noqa: BLE001 - any failure on meta parameters (``.item()``, numpy of a weight): build plainly
        return make(), False
    return model, True
