"""A misread placed inside the stack's own checkpoint loaders: e4m3fn bytes handed back as e4m3fnuz.

This is the NVIDIA-checkpoint-on-MI300 bug (docs/faults.md section 2) where it really sits: in the
library that loads the file, not in the formats scenario's code. Mode ``loader_fn_as_fnuz`` of fault
kind ``format`` wraps, for each chosen ``path`` of the formats scenario's io cases:
  safetensors    safetensors.torch.load_file
  safe_open      safetensors.safe_open (get_tensor and get_slice of the handle it opens)
  torch_load     torch.load
  dcp            torch.distributed.checkpoint.load (the state dict it fills)
  transformers   the safe_open transformers.modeling_utils reads checkpoints with
Every float8_e4m3fn tensor they hand back becomes a float8_e4m3fnuz view of the same bytes; each
tensor so misread counts as one firing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from . import FaultSpec
from .firing import Firing


def install(spec: FaultSpec, ctx: Any) -> Firing:
    from ..scenarios.formats.catalog import IO_PATHS

    firing = Firing(spec.text)
    paths = [spec.get("path")] if spec.get("path") else list(IO_PATHS)
    for path in paths:
        module_name, attribute, wrap = TARGETS[path]
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        setattr(module, attribute, wrap(original, firing))
        ctx.cleanup_hooks.append(lambda m=module, a=attribute, o=original: setattr(m, a, o))
    return firing


def misread(value: Any, firing: Firing) -> Any:
    """``value`` with every float8_e4m3fn tensor in it (a tensor, or a dict of them) viewed as float8_e4m3fnuz."""
    import torch

    if isinstance(value, dict):
        return {key: misread(item, firing) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.dtype == torch.float8_e4m3fn:
        firing.fire()
        from torch.distributed.tensor import DTensor

        return (value.to_local() if isinstance(value, DTensor) else value).view(torch.float8_e4m3fnuz)
    return value


def _returning(load: Callable[..., Any], firing: Firing) -> Callable[..., Any]:
    def misreading_load(*args: Any, **kwargs: Any) -> Any:
        return misread(load(*args, **kwargs), firing)

    return misreading_load


def _filling(load: Callable[..., Any], firing: Firing) -> Callable[..., Any]:
    """DCP loads in place: the state dict's e4m3fn entries are replaced after the real load."""

    def misreading_load(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = load(state_dict, *args, **kwargs)
        state_dict.update(misread(dict(state_dict), firing))
        return result

    return misreading_load


class _Slice:
    def __init__(self, inner: Any, firing: Firing) -> None:
        self._inner, self._firing = inner, firing

    def __getitem__(self, index: Any) -> Any:
        return misread(self._inner[index], self._firing)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Handle:
    """A safe_open handle whose tensors come back misread; everything else is the real handle's."""

    def __init__(self, inner: Any, firing: Firing) -> None:
        self._inner, self._firing = inner, firing

    def __enter__(self) -> _Handle:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> Any:
        return misread(self._inner.get_tensor(name), self._firing)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._inner.get_slice(name), self._firing)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _opening(safe_open: Callable[..., Any], firing: Firing) -> Callable[..., Any]:
    def misreading_open(*args: Any, **kwargs: Any) -> _Handle:
        return _Handle(safe_open(*args, **kwargs), firing)

    return misreading_open


# path -> (module, attribute, wrapper)
TARGETS: dict[str, tuple[str, str, Callable[[Callable[..., Any], Firing], Callable[..., Any]]]] = {
    "safetensors": ("safetensors.torch", "load_file", _returning),
    "safe_open": ("safetensors", "safe_open", _opening),
    "torch_load": ("torch", "load", _returning),
    "dcp": ("torch.distributed.checkpoint", "load", _filling),
    "transformers": ("transformers.modeling_utils", "safe_open", _opening),
}
